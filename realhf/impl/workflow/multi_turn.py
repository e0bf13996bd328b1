"""``multi_turn``: answer, and after a wrong answer try again within the same sequence, told that it was wrong.

Per sample of the group: the model answers (the first turn of all ``n`` samples is one request, the prompt
prefilled once); a correct answer ends the sample; a wrong one, while turns remain, is followed by the
``feedback`` text as tokens (a user turn of the tokenizer's chat template when it has one, e.g.
``<|im_end|>\\n<|im_start|>user\\n{feedback}<|im_end|>\\n<|im_start|>assistant\\n``; else the plain text on a line
of its own) and the model answers again after it, the whole sequence so far being the next request's prompt.
The feedback tokens are not generated: ``prompt_mask`` True, log-prob 0, version -1, so training leaves them out
of the loss. Every turn may generate up to ``max_new_tokens``; with ``max_seq_len`` a sample stops turning when
the next turn might not fit.

Reward: ``r * turn_discount ** (turns - 1)`` when the answer of turn ``turns`` is correct (``r``: that turn's
reward, ``correct_reward`` for ``MathReward``), else the last turn's reward (``wrong_reward``). A turn's answer is
correct when its reward reaches ``correct_if`` (default: the reward function's ``correct_reward`` if it has one,
else any reward > 0). Each turn is graded on that turn's answer alone.

Note for training: the feedback tokens sit between answer tokens, so the answer is not one span after the prompt;
losses that mask by ``answer_loss_mask`` (GRPO) handle that, GAE over "the tokens after the prompt" does not.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from realhf.api.core.generation import SampleOutput
from realhf.api.core.workflow_api import RolloutWorkflow, Trajectory, register_workflow
from realhf.base import logging
from realhf.impl.workflow.rewards import call_reward, load_reward_fn
from realhf.impl.workflow.rlvr import (SequenceBuilder, decode, episode_seed, new_rid, prompt_ids, sampling_params,
                                       sub_seed)

logger = logging.getLogger(__name__)

_MARK = "REALHF_ANSWER_MARK_7f3a"  # stands for an answer when the chat template is rendered around one


class FeedbackTokens:
    """The token ids inserted after an answer: the end of the assistant turn (unless the answer already ended with
    it), the feedback as a user turn, and the start of the next assistant turn."""

    def __init__(self, tokenizer, feedback: str, use_chat_template: Optional[bool] = None):
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_template:
            raise ValueError("multi_turn: use_chat_template=True but the tokenizer has no chat template")
        self.chat = has_template if use_chat_template is None else bool(use_chat_template)
        if self.chat:
            self.end_of_turn, self.user_turn = self._template_parts(feedback)
        else:
            self.end_of_turn, self.user_turn = "", f"\n{feedback}\n"
        self._cache: Dict[Tuple[bool, int], List[int]] = {}

    def _template_parts(self, feedback: str) -> Tuple[str, str]:
        tok = self.tokenizer
        conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK}]
        base = tok.apply_chat_template(conv, tokenize=False)
        full = tok.apply_chat_template(conv + [{"role": "user", "content": feedback}], tokenize=False,
                                       add_generation_prompt=True)
        if _MARK in base and full.startswith(base):
            return base[base.rindex(_MARK) + len(_MARK):], full[len(base):]
        # a template that renders an earlier assistant turn unlike the last one: close the turn with EOS
        logger.warning("multi_turn: the chat template renders turns in a way the workflow cannot splice; the "
                       "feedback follows as a fresh user turn after the EOS token")
        eos = tok.eos_token or ""
        user = tok.apply_chat_template([{"role": "user", "content": feedback}], tokenize=False,
                                       add_generation_prompt=True)
        return eos + "\n", user

    def after(self, out: SampleOutput) -> List[int]:
        """The ids to insert after the answer ``out``."""
        stopped = out.finish_reason == "stop" and bool(out.output_ids)
        key = (stopped, out.output_ids[-1] if stopped else -1)
        if key not in self._cache:
            head = self.end_of_turn
            if stopped:  # the answer ended with a stop token: it may already be (the start of) the end of the turn
                stop_text = self.tokenizer.decode([key[1]], skip_special_tokens=False)
                if stop_text and head.startswith(stop_text):
                    head = head[len(stop_text):]
            text = head + self.user_turn
            self._cache[key] = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        return list(self._cache[key])


class MultiTurnWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn: Union[Callable, str, None], gconfig: Union[Dict[str, Any], Any], tokenizer,
                 max_turns: int = 2, turn_discount: float = 0.5, feedback: str = "Your answer is wrong. Try again.",
                 use_chat_template: Optional[bool] = None, max_seq_len: Optional[int] = None,
                 correct_if: Optional[float] = None):
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"multi_turn max_turns must be an integer >= 1, got {max_turns!r}")
        if not (isinstance(turn_discount, (int, float)) and 0 < turn_discount <= 1):
            raise ValueError(f"multi_turn turn_discount must be in (0, 1], got {turn_discount!r}")
        if not isinstance(feedback, str) or not feedback.strip():
            raise ValueError(f"multi_turn feedback must be a non-empty string, got {feedback!r}")
        self.reward_fn = load_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.sampling, self.base_seed = sampling_params(gconfig, tokenizer)
        if max_seq_len is not None and max_seq_len < self.sampling.max_new_tokens + 1:
            raise ValueError(f"multi_turn max_seq_len={max_seq_len} leaves no room for one turn of max_new_tokens="
                             f"{self.sampling.max_new_tokens}")
        self.max_turns, self.turn_discount = max_turns, float(turn_discount)
        self.max_seq_len = max_seq_len
        self.feedback = FeedbackTokens(tokenizer, feedback, use_chat_template)
        if correct_if is None:
            correct_if = getattr(self.reward_fn, "correct_reward", None)
        self.correct_if = None if correct_if is None else float(correct_if)

    FEEDBACK_BUDGET = 64  # tokens of one feedback turn (with its chat-template wrapping) when sizing the servers

    @classmethod
    def seq_len_budget(cls, max_prompt_len: int, max_new_tokens: int, **workflow_args) -> int:
        """``max_seq_len`` when given; else the prompt, ``max_turns`` answers and the feedback turns between them."""
        if workflow_args.get("max_seq_len"):
            return int(workflow_args["max_seq_len"])
        turns = int(workflow_args.get("max_turns", 2))
        return int(max_prompt_len) + turns * int(max_new_tokens) + (turns - 1) * cls.FEEDBACK_BUDGET

    def is_correct(self, reward: float) -> bool:
        return reward > 0 if self.correct_if is None else reward >= self.correct_if

    async def arun_episode(self, engine, data: Dict[str, Any]) -> Optional[Trajectory]:
        prompt = prompt_ids(data)
        seed = episode_seed(self.base_seed, data, engine.version)
        rid = new_rid(data)
        first = await engine.agenerate(prompt, dataclasses.replace(self.sampling, seed=seed), rid)
        results = await asyncio.gather(*(self._sample(engine, data, prompt, out, j, seed, rid)
                                         for j, out in enumerate(first.outputs)))
        samples = [r[0] for r in results]
        n = len(samples)
        interruptions = getattr(first, "interruptions", 0) + sum(r[3] for r in results)
        stats = {"reward": sum(s.reward for s in samples) / n, "turns": sum(r[1] for r in results) / n,
                 "success": sum(r[2] for r in results) / n,
                 "answer_len": sum(s.n_generated for s in samples) / n,
                 "no_eos_ratio": sum(s.no_eos for s in samples) / n, "interruptions": float(interruptions)}
        return Trajectory(query_id=str(data.get("query_id")), samples=samples, stats=stats)

    async def _sample(self, engine, data, prompt: List[int], out: SampleOutput, j: int, seed: Optional[int],
                      rid: str):
        """(the AnswerSample of sample ``j`` after all its turns, the number of turns, whether it ended correct,
        interruptions)."""
        seq = SequenceBuilder(prompt)
        turn, interruptions = 1, 0
        while True:
            seq.generated(out)
            r = await call_reward(self.reward_fn, decode(self.tokenizer, out.output_ids), data,
                                  finish_reason=out.finish_reason)
            correct = self.is_correct(r)
            if correct:
                reward = r * self.turn_discount ** (turn - 1)
                break
            reward = r
            if turn >= self.max_turns:
                break
            fb = self.feedback.after(out)
            if self.max_seq_len is not None and \
                    len(seq.ids) + len(fb) + self.sampling.max_new_tokens > self.max_seq_len:
                break
            seq.inserted(fb)
            turn += 1
            sp = dataclasses.replace(self.sampling, n=1, seed=sub_seed(seed, j, turn))
            res = await engine.agenerate(list(seq.ids), sp, f"{rid}-t{turn}-{j}")
            interruptions += getattr(res, "interruptions", 0)
            out = res.outputs[0]
        return seq.build(no_eos=out.finish_reason != "stop", reward=reward), turn, correct, interruptions


register_workflow("multi_turn", MultiTurnWorkflow)
