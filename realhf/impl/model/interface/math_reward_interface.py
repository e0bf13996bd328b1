"""`rw-math`: rule-based reward of math answers, graded by ``realhf.reward`` (safe and time-bounded).

Input: ``packed_input_ids`` + ``prompt_mask`` (several answers per prompt sample) and the sample
metadata ``solutions``; with ``unfinished_as_wrong`` also ``seq_no_eos_mask`` (actor_gen's: the answer was cut
by max_new_tokens before a stop token). Output: ``rewards``, one float per answer:
``((correct_reward if correct else wrong_reward) + reward_output_bias) * reward_output_scaling``.
The grading is the rollout workflows' (:class:`realhf.impl.workflow.rewards.MathReward`, built from the same
options): verification timeouts and errors score as wrong and are counted in the stats; with
``unfinished_as_wrong`` an unfinished answer scores ``wrong_reward`` whatever it states (not graded; counted as
``n_unfinished``). The options are the experiment's ``reward`` section (``RewardConfig.grader_args``) and
``ppo.reward_output_scaling``, ``ppo.reward_output_bias``, and have no defaults here, so none can be left out.
"""
from __future__ import annotations

import threading
from typing import List

import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, register_interface
from realhf.base import logging
from realhf.impl.workflow.rewards import MathReward

logger = logging.getLogger(__name__)


class MathRewardInterface(ModelInterface):
    def __init__(self, *, correct_reward: float, wrong_reward: float, reward_output_scaling: float,
                 reward_output_bias: float, timeout_secs: float, allow_last_number: bool, unfinished_as_wrong: bool,
                 max_workers: int = 2):
        # max_workers: grading processes (not an option: grading is cheap next to generation)
        self.grader = MathReward(correct_reward=correct_reward, wrong_reward=wrong_reward, timeout_secs=timeout_secs,
                                 allow_last_number=allow_last_number, unfinished_as_wrong=unfinished_as_wrong,
                                 max_workers=max_workers)
        self.reward_output_scaling, self.reward_output_bias = reward_output_scaling, reward_output_bias

    # the grader's options, as it holds them
    correct_reward = property(lambda self: self.grader.correct_reward)
    wrong_reward = property(lambda self: self.grader.wrong_reward)
    timeout_secs = property(lambda self: self.grader.timeout_secs)
    allow_last_number = property(lambda self: self.grader.allow_last_number)
    unfinished_as_wrong = property(lambda self: self.grader.unfinished_as_wrong)

    @property
    def verifier(self):
        return self.grader.verifier

    @property
    def _verifier(self):
        """The grader's verifier, None until something was graded (to close it)."""
        return self.grader._verifier

    def warmup(self, model: Model) -> None:
        """Start the grading processes now (their imports take about a second) rather than inside the first
        step that needs a symbolic comparison."""
        threading.Thread(target=self.verifier.pool.warmup, name="rw-math-warmup", daemon=True).start()

    def answers(self, model: Model, data: SequenceSample) -> List[str]:
        ids = data.data["packed_input_ids"]
        pm = data.data["prompt_mask"].bool()
        texts, off = [], 0
        for n in data.flat_seqlens("packed_input_ids"):
            seq, m = ids[off : off + n], pm[off : off + n]
            texts.append(model.tokenizer.decode(seq[~m].tolist(), skip_special_tokens=True))
            off += n
        return texts

    def unfinished(self, data: SequenceSample, n_answers: int) -> List[bool]:
        """Per answer: cut before it ended (all False unless ``unfinished_as_wrong``)."""
        if not self.unfinished_as_wrong:
            return [False] * n_answers
        if "seq_no_eos_mask" not in data.data:
            raise KeyError("rw-math with unfinished_as_wrong=True needs 'seq_no_eos_mask' (actor_gen's output) among "
                           f"its inputs; it got {sorted(data.data)}")
        mask = data.data["seq_no_eos_mask"].bool().flatten().tolist()
        if len(mask) != n_answers:
            raise ValueError(f"rw-math: seq_no_eos_mask has {len(mask)} entries for {n_answers} answers")
        return mask

    @torch.no_grad()
    def inference(self, model: Model, data: SequenceSample, mb_spec) -> SequenceSample:
        texts = self.answers(model, data)
        sols = data.metadata.get("solutions")
        if sols is None:
            raise KeyError("rw-math needs the sample metadata 'solutions' (a math dataset provides it)")
        per_sample = [len(x) for x in data.seqlens["packed_input_ids"]]
        sol_per_answer = [s for s, k in zip(sols, per_sample) for _ in range(k)]
        cut = self.unfinished(data, len(texts))
        results = self.grader.grade_many(texts, sol_per_answer, cut)  # an unfinished answer is wrong, ungraded
        raw = torch.tensor([r for r, _ in results], dtype=torch.float32)
        rewards = (raw + self.reward_output_bias) * self.reward_output_scaling
        n_to = sum(1 for _, st in results if st == "timeout")
        n_err = sum(1 for _, st in results if st == "error")
        if n_to or n_err:
            logger.info(f"rw-math: {n_to} verification timeout(s), {n_err} error(s) scored as wrong")
        out = SequenceSample(keys={"rewards"}, ids=list(data.ids), seqlens={"rewards": [[1] * k for k in per_sample]},
                             trailing_shapes={"rewards": ()}, dtypes={"rewards": torch.float32}, data={"rewards": rewards})
        self.last_stats = {"n_verify_timeout": float(n_to), "n_verify_error": float(n_err)}
        if self.unfinished_as_wrong:
            self.last_stats["n_unfinished"] = float(sum(cut))
        return out


register_interface("rw-math", MathRewardInterface)
