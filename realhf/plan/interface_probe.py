"""What a call costs beside its passes, measured on the real code a run executes, on a small model of the profiled
shape's width: the PPO actor's ``train_step`` (advantages, the per-token loss and its weights, micro-batch splitting,
the statistics) and ``generate`` (sampling, the answers' lists), each timed whole less what the cost model gives for
its passes on the same machine (a generation server's own cost is measured the same way by
:mod:`realhf.gen_server.probe`); and the rule-based reward's grading per answer. What is left is a
fixed cost of every such call, which a small model's step is made of and a large model's hardly notices.

Used by :mod:`realhf.plan.profile`; returns plain numbers.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Dict, Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.plan.hardware import Hardware

PROBE_PROMPTS, PROBE_GROUP = 8, 4  # a small batch of answers: prompts x answers per prompt
PROBE_PROMPT_LEN, PROBE_ANSWER_LEN = 4, 16
# idle before each timed call, as a model worker waits for its next request between a step's calls: the tiny model's
# generation took 1-2 ms (~10%) more after 30 ms idle or after a training call than back to back (AMD EPYC, 2 cores)
CALL_GAP_S = 0.03


def _batch(vocab: int, prompts: int = PROBE_PROMPTS):
    """A GRPO batch: ``prompts`` prompts with PROBE_GROUP answers each, rewards 0 or 1, behaviour log-probs."""
    import torch

    from realhf.api.core.data_api import SequenceSample

    g = torch.Generator().manual_seed(0)
    P, A, n = PROBE_PROMPT_LEN, PROBE_ANSWER_LEN, prompts * PROBE_GROUP
    ids = torch.randint(3, vocab, (n, P + A), generator=g)
    lp = torch.zeros(n, P + A)
    lp[:, P - 1:P + A - 1] = -2.0 - torch.rand(n, A, generator=g)
    pm = torch.zeros(n, P + A, dtype=torch.bool)
    pm[:, :P] = True
    data = {"packed_input_ids": ids.flatten(), "packed_logprobs": lp.flatten(), "prompt_mask": pm.flatten(),
            "seq_no_eos_mask": torch.zeros(n, dtype=torch.bool),
            "rewards": (torch.arange(n) % 2).float()}
    seqlens = [[P + A] * PROBE_GROUP for _ in range(prompts)]
    per_token = ("packed_input_ids", "packed_logprobs", "prompt_mask")
    return SequenceSample(keys=set(data), ids=list(range(prompts)),
                          seqlens={**{k: seqlens for k in per_token},
                                   "seq_no_eos_mask": [[1] * PROBE_GROUP] * prompts,
                                   "rewards": [[1] * PROBE_GROUP] * prompts},
                          trailing_shapes={k: () for k in data}, dtypes={k: v.dtype for k, v in data.items()},
                          data=data)


def time_train_call(cfg: ReaLModelConfig, grid, prompts: int, dtype: str, device: str, reps: int = 5) -> float:
    """Median seconds of the PPO actor's real ``train_step`` on a model of ``cfg`` laid out on ``grid`` (this
    process's rank of it; every rank of the grid calls this at once) over ``prompts`` prompts of the probe's batch,
    each after ``CALL_GAP_S`` idle; the two warm-up calls build the optimizer's state and warm the kernels."""
    import torch

    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.plan.probes import timed

    m = ReaLModel(cfg, grid=grid, dtype=getattr(torch, dtype), device=device)
    m.init_random(seed=1)
    model = Model(name="actor", engine=TrainEngine(m, OptimizerConfig(lr=1e-6), 1000), tokenizer=None, grid=grid,
                  path="")
    iface = PPOActorInterface(PPOHyperparameters(ppo_n_minibatches=1, kl_ctl=0.0), group_size=PROBE_GROUP,
                              use_critic=False, seed=1)
    batch, mb = _batch(cfg.vocab_size, prompts), MicroBatchSpec()
    return timed(lambda: iface.train_step(model, batch, mb), device, reps=reps, budget_s=math.inf, gap_s=CALL_GAP_S)


def dp_train_call(device: str, cfg: Dict, dtype: str, prompts: int) -> Dict:
    """On each of two ranks of a process group (the link probe's, :func:`realhf.plan.probes.comm`): the PPO actor's
    real training call with model ``cfg`` (a config dict) replicated over the two (d2m1p1), ``prompts`` of the probe's
    prompts on each; what a data-parallel training call takes with its collectives (the gradients' all-reduce, the
    interface's and the engine's small ones, each also waiting for the later rank)."""
    from realhf.base.topology import ParallelDims, ParallelGrid

    grid = ParallelGrid(ParallelDims.parse("d2m1p1"), ranks=[0, 1])
    return dict(layers=cfg["n_layers"], prompts=prompts,
                measured_s=time_train_call(ReaLModelConfig(**cfg), grid, prompts, dtype, device))


def train_call_overhead(cfg: ReaLModelConfig, hw: Hardware, dtype: str, device: str,
                        reps: int = 5) -> Tuple[float, dict]:
    """(seconds a training call spends beside its passes: the median of the real ``train_step`` on the probe batch
    less the cost model's training pass and optimizer step on ``hw`` (at least 0), the figures behind it). ``cfg``: a
    small model (the profiler's proxy)."""
    from realhf.base.topology import single_process_grid
    from realhf.plan.cost import CostModel
    from realhf.plan.memory import Shard, dtype_bytes, params

    measured = time_train_call(cfg, single_process_grid(), PROBE_PROMPTS, dtype, device, reps)
    tokens = PROBE_PROMPTS * PROBE_GROUP * (PROBE_PROMPT_LEN + PROBE_ANSWER_LEN)
    cm = CostModel(cfg, hw, dtype)
    passes = (cm.train(tokens, 1, PROBE_PROMPT_LEN + PROBE_ANSWER_LEN, tokens)
              + cm.optimizer_step(params(Shard(cfg, 1, 1, 0, dtype_bytes(dtype)))))
    return max(0.0, measured - passes), dict(measured_s=measured, passes_s=passes)


def time_generate_call(cfg: ReaLModelConfig, grid, dtype: str, device: str, reps: int = 5) -> float:
    """Median seconds of the PPO actor's real ``generate`` on a model of ``cfg`` laid out on ``grid`` (this process's
    rank of it; every rank of the grid calls this at once): ``PROBE_PROMPTS`` prompts of ``PROBE_PROMPT_LEN`` tokens,
    ``PROBE_GROUP`` answers each of exactly ``PROBE_ANSWER_LEN`` tokens, sampled with the default sampling options,
    each call after ``CALL_GAP_S`` idle."""
    import types

    import torch

    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.plan.probes import timed

    m = ReaLModel(cfg, grid=grid, dtype=getattr(torch, dtype), device=device)
    m.init_random(seed=1)
    # the interface reads the tokenizer's end-of-sequence id alone: a run's tokenizer has one, and generation then
    # holds it back until min_new_tokens (about 4% of a small model's generation)
    eos_only = types.SimpleNamespace(eos_token_id=2)
    model = Model(name="actor", engine=InferenceEngine(m), tokenizer=eos_only, grid=grid, path="")
    ppo = PPOHyperparameters(kl_ctl=0.0)
    ppo.gen.max_new_tokens = ppo.gen.min_new_tokens = PROBE_ANSWER_LEN
    iface = PPOActorInterface(ppo, group_size=PROBE_GROUP, use_critic=False, seed=1)
    g = torch.Generator().manual_seed(0)
    P = PROBE_PROMPT_LEN
    prompts = torch.randint(3, cfg.vocab_size, (PROBE_PROMPTS * P,), generator=g)
    data = SequenceSample(keys={"packed_prompts"}, ids=list(range(PROBE_PROMPTS)),
                          seqlens={"packed_prompts": [[P] for _ in range(PROBE_PROMPTS)]},
                          trailing_shapes={"packed_prompts": ()}, dtypes={"packed_prompts": torch.long},
                          data={"packed_prompts": prompts})
    return timed(lambda: iface.generate(model, data, MicroBatchSpec()), device, reps=reps, budget_s=math.inf,
                 gap_s=CALL_GAP_S)


def generate_call_overhead(cfg: ReaLModelConfig, hw: Hardware, dtype: str, device: str,
                           reps: int = 5) -> Tuple[float, dict]:
    """(seconds a generation call spends beside its prefill and decode steps: the median of the real PPO actor's
    ``generate`` in this process (:func:`time_generate_call`) less the cost model's generation on ``hw`` without its
    own setup costs (at least 0), the figures behind it). ``cfg``: a small model (the profiler's proxy)."""
    from realhf.base.topology import single_process_grid

    measured = time_generate_call(cfg, single_process_grid(), dtype, device, reps)
    passes = generation_passes(cfg, hw, dtype)
    return max(0.0, measured - passes), dict(measured_s=measured, passes_s=passes)


def pp_generate_call(device: str, cfg: Dict, dtype: str) -> Dict:
    """On each of two ranks of a process group (the link probe's, :func:`realhf.plan.probes.comm`): the PPO actor's
    real generation with model ``cfg`` (a config dict) in two pipeline stages (d1m1p2), the probe's batch; what a
    pipelined generation takes with its stages' messages (each decode step's activations forward, its sampled tokens
    back to the first stage)."""
    from realhf.base.topology import ParallelDims, ParallelGrid

    grid = ParallelGrid(ParallelDims.parse("d1m1p2"), ranks=[0, 1])
    return dict(layers=cfg["n_layers"], measured_s=time_generate_call(ReaLModelConfig(**cfg), grid, dtype, device))


def pp_train_call(device: str, cfg: Dict, dtype: str, prompts: int) -> Dict:
    """On each of two ranks of a process group: the PPO actor's real training call with model ``cfg`` in two pipeline
    stages (d1m1p2) over ``prompts`` of the probe's prompts; what a pipelined training call takes with its stages'
    activations and gradients and their waits."""
    from realhf.base.topology import ParallelDims, ParallelGrid

    grid = ParallelGrid(ParallelDims.parse("d1m1p2"), ranks=[0, 1])
    return dict(layers=cfg["n_layers"], prompts=prompts,
                measured_s=time_train_call(ReaLModelConfig(**cfg), grid, prompts, dtype, device))


def generation_passes(cfg: ReaLModelConfig, hw: Hardware, dtype: str) -> float:
    """The cost model's prefill and decode steps of the probe's generation (``PROBE_PROMPTS`` prompts of
    ``PROBE_PROMPT_LEN`` tokens, ``PROBE_GROUP`` answers of ``PROBE_ANSWER_LEN`` tokens each) on ``hw``, without a
    call's own costs."""
    import dataclasses

    from realhf.plan.cost import CostModel

    bare = dataclasses.replace(hw, generate_overhead_s=0.0, generate_layer_overhead_s=0.0, generate_head_overhead_s=0.0)
    return CostModel(cfg, bare, dtype).generate(PROBE_PROMPTS, PROBE_PROMPT_LEN, PROBE_GROUP, PROBE_ANSWER_LEN)


def reward_per_answer(n: int = 64, reps: int = 5) -> Tuple[float, dict]:
    """(seconds per answer of the rule-based math reward, the figures behind it): the real grader
    (:class:`realhf.impl.workflow.rewards.MathReward`, the last number allowed) over ``n`` short answers to arithmetic
    problems, half of them right, the median of ``reps`` rounds after one that starts the grader."""
    from realhf.impl.dataset import make_arithmetic_problems
    from realhf.impl.workflow.rewards import MathReward

    problems = make_arithmetic_problems(n, seed=5, kind="easy")
    sols = [p["solutions"] for p in problems]
    texts = [f"{p['prompt']} We add the numbers step by step, so the answer is "
             f"{p['solutions'][0] if i % 2 else int(p['solutions'][0]) + 1}." for i, p in enumerate(problems)]
    grader = MathReward(allow_last_number=True)
    try:
        ts = []
        for i in range(reps + 1):
            t = time.perf_counter()
            grader.grade_many(texts, sols)
            if i:
                ts.append(time.perf_counter() - t)
    finally:
        grader.close()
    per = statistics.median(ts) / n
    return per, dict(answers=n, round_s=statistics.median(ts))
