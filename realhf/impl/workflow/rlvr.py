"""``rlvr``: one turn, a verifiable reward (GRPO on math): the prompt's group of ``n`` answers in one request.

The request holds the ``n`` samples (the servers prefill the prompt once and keep the group on one server); each
answer is decoded and scored by the reward function; the episode's :class:`Trajectory` holds the group. The
sampling options (``gconfig``) are the fields of the generation contract's ``GenerationHyperparameters``
(``realhf.api.core.generation``: the experiment's ``ppo.gen`` section, with ``n``); the tokenizer's EOS is always
a stop token.

Shared with ``multi_turn``: :func:`sampling_params` (gconfig -> SamplingParams), :func:`episode_seed` and
:class:`SequenceBuilder` (the token-aligned lists of one sequence).
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from realhf.api.core.workflow_api import AnswerSample, RolloutWorkflow, Trajectory, register_workflow
from realhf.api.core.generation import GenerationHyperparameters, SampleOutput, SamplingParams
from realhf.impl.workflow.rewards import call_reward, load_reward_fn

# gconfig keys: the sampling section's (its decode options are the servers' business: not sent with a request)
_SAMPLING_KEYS = tuple(SamplingParams.request_fields())
GCONFIG_KEYS = tuple(sorted(f.name for f in dataclasses.fields(GenerationHyperparameters)))


def sampling_params(gconfig: Union[Dict[str, Any], Any], tokenizer) -> Tuple[SamplingParams, Optional[int]]:
    """``(SamplingParams without a seed, the base seed)`` of ``gconfig`` (a dict of ``GenerationHyperparameters``
    fields, or such a dataclass); EOS of ``tokenizer`` joins the stop tokens."""
    if dataclasses.is_dataclass(gconfig) and not isinstance(gconfig, type):
        gconfig = dataclasses.asdict(gconfig)
    if not isinstance(gconfig, dict):
        raise TypeError(f"gconfig must be a dict of sampling options, got {type(gconfig).__name__}")
    unknown = sorted(set(gconfig) - set(GCONFIG_KEYS))
    if unknown:
        raise ValueError(f"gconfig has unknown keys {unknown}; allowed: {list(GCONFIG_KEYS)}")
    kw = {k: v for k, v in gconfig.items() if k in _SAMPLING_KEYS and k != "seed"}
    stop = [int(t) for t in kw.pop("stop_token_ids", None) or []]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and int(eos) not in stop:
        stop.append(int(eos))
    try:
        sp = SamplingParams(stop_token_ids=stop, **kw).validate()
    except ValueError as e:
        raise ValueError(f"gconfig {gconfig}: {e}") from None
    seed = gconfig.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"gconfig seed must be an integer or null, got {seed!r}")
    return sp, seed


def episode_seed(base_seed: Optional[int], data: Dict[str, Any], version: int) -> Optional[int]:
    """The seed of an episode's requests: ``data["seed"]`` as it is when the rollout worker gives one (it seeds
    episodes as a synchronous run seeds a prompt's samples), else derived from the base seed, the query and the
    weight version (None without a base seed: the servers' own streams)."""
    if data.get("seed") is not None:
        return int(data["seed"])
    if base_seed is None:
        return None
    return zlib.crc32(f"{base_seed}:{data.get('query_id')}:{version}".encode()) & 0x7FFFFFFF


def sub_seed(seed: Optional[int], *parts) -> Optional[int]:
    if seed is None:
        return None
    return zlib.crc32(":".join(map(str, (seed, *parts))).encode()) & 0x7FFFFFFF


def new_rid(data: Dict[str, Any]) -> str:
    return f"{str(data.get('query_id', 'q'))[:120]}-{uuid.uuid4().hex[:10]}"


def prompt_ids(data: Dict[str, Any]) -> List[int]:
    ids = data.get("input_ids")
    if not ids:
        raise KeyError(f"episode data of query {data.get('query_id')!r} has no input_ids (the tokenized prompt); "
                       "build it with realhf.api.core.workflow_api.episode_data")
    return [int(t) for t in ids]


class SequenceBuilder:
    """The token-aligned lists of one sequence, built piece by piece: the prompt, generated pieces (with their
    log-probs and versions) and inserted pieces (feedback: not generated)."""

    def __init__(self, prompt: List[int]):
        self.ids: List[int] = list(prompt)
        self.pm: List[bool] = [True] * len(prompt)
        self.own_lp: List[float] = [0.0] * len(prompt)  # log-prob of each token itself (0 when not generated)
        self.vers: List[int] = [-1] * len(prompt)
        self.n_generated = 0

    def generated(self, out: SampleOutput):
        n = len(out.output_ids)
        if not (len(out.logprobs) == len(out.versions) == n):
            raise ValueError(f"a sample came back with {n} tokens, {len(out.logprobs)} log-probs and "
                             f"{len(out.versions)} versions")
        self.ids += list(out.output_ids)
        self.pm += [False] * n
        self.own_lp += [float(x) for x in out.logprobs]
        self.vers += [int(v) for v in out.versions]
        self.n_generated += n

    def inserted(self, ids: List[int]):
        self.ids += list(ids)
        self.pm += [True] * len(ids)
        self.own_lp += [0.0] * len(ids)
        self.vers += [-1] * len(ids)

    def build(self, no_eos: bool, reward: float) -> AnswerSample:
        # packed_logprobs[t] is the log-prob of token t+1: shift by one, 0 on the last position
        return AnswerSample(input_ids=list(self.ids), prompt_mask=list(self.pm), logprobs=self.own_lp[1:] + [0.0],
                            versions=list(self.vers), no_eos=no_eos, reward=reward)


def decode(tokenizer, ids: List[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


class RLVRWorkflow(RolloutWorkflow):
    """``reward_fn``: ``(completion_text, data) -> float`` (async or not; see ``realhf.impl.workflow.rewards``),
    an import path of one, or None for the default ``MathReward``; it sees how each answer ended as
    ``data["finish_reason"]`` ("stop": a stop token; else cut). ``gconfig``: sampling options and ``n``."""

    def __init__(self, reward_fn: Union[Callable, str, None], gconfig: Union[Dict[str, Any], Any], tokenizer):
        self.reward_fn = load_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.sampling, self.base_seed = sampling_params(gconfig, tokenizer)

    async def arun_episode(self, engine, data: Dict[str, Any]) -> Optional[Trajectory]:
        prompt = prompt_ids(data)
        sp = dataclasses.replace(self.sampling, seed=episode_seed(self.base_seed, data, engine.version))
        res = await engine.agenerate(prompt, sp, new_rid(data))
        outs = res.outputs
        texts = [decode(self.tokenizer, o.output_ids) for o in outs]
        rewards = await asyncio.gather(*(call_reward(self.reward_fn, t, data, finish_reason=o.finish_reason)
                                         for t, o in zip(texts, outs)))
        samples = []
        for o, r in zip(outs, rewards):
            b = SequenceBuilder(prompt)
            b.generated(o)
            samples.append(b.build(no_eos=o.finish_reason != "stop", reward=r))
        n = len(samples)
        stats = {"reward": sum(rewards) / n, "answer_len": sum(len(o.output_ids) for o in outs) / n,
                 "no_eos_ratio": sum(s.no_eos for s in samples) / n,
                 "interruptions": float(getattr(res, "interruptions", 0))}
        return Trajectory(query_id=str(data.get("query_id")), samples=samples, stats=stats)


register_workflow("rlvr", RLVRWorkflow)
