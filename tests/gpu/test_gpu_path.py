"""The GPU path: NCCL reallocation, flash-attn, a bf16 PPO step and generation on CUDA (every test needs CUDA).

Each distributed test runs its ranks in the environment ``realhf.base.runtime_env.detect`` gives them
(``cuda:<rank>``, ``cpu:gloo,cuda:nccl``, bf16, flash-attn when installed). NCCL cannot join two ranks on
one GPU, so the reallocation test needs two GPUs or more.
"""
import itertools

import pytest
import torch

from realhf.base.runtime_env import detect, flash_attn_importable, select
from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7], [11, 12, 13, 14, 15, 16, 17], [8, 99]]


def _path():
    # 6 query / 3 kv heads (uneven over tp=2), tied embeddings
    return ensure_tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                             tie_word_embeddings=True)


def _cuda_env(**overrides):
    return select(cuda_available=True, device_count=torch.cuda.device_count(),
                  flash_attn_available=flash_attn_importable(), **overrides)


# ------------------------------------------------------------------ NCCL reallocation
def _realloc_pairs(path, layouts, runtime_env):
    import torch.distributed as dist

    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf, config_from_hf_path
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.parallelism.realloc import PlacedLayout, execute_plan, make_plan

    env, rank = runtime_env, dist.get_rank()
    assert env.is_cuda and "nccl" in dist.get_backend(), (env.describe(), dist.get_backend())
    cfg = config_from_hf_path(path)
    layouts = [ParallelDims.parse(s) for s in layouts]
    grids = [ParallelGrid(d, ranks=list(range(d.world_size)), backend=env.backend) for d in layouts]
    loaded = {d: build_from_hf(path, grid=g, env=env) for d, g in zip(layouts, grids) if g.is_member}
    out = []
    for (a, ga), (b, gb) in itertools.permutations(list(zip(layouts, grids)), 2):
        plan = make_plan(cfg, PlacedLayout.of(a, ga.ranks), PlacedLayout.of(b, gb.ranks))
        dst = ReaLModel(cfg, grid=gb, env=env) if gb.is_member else None
        if dst is not None:
            dst.init_random(seed=5)
        execute_plan(plan, rank, loaded[a].flat if a in loaded else None, dst.flat if dst is not None else None)
        if dst is not None:
            assert dst.flat.is_cuda and dst.flat.dtype == env.dtype
            out.append((str(a), str(b), torch.equal(dst.flat, loaded[b].flat)))
        dist.barrier()
    return out


def test_nccl_reallocation_is_bit_exact_across_layouts():
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("NCCL reallocation needs 2 GPUs or more (NCCL joins no two ranks on one GPU)")
    layouts = ["d1m1p1", "d2m1p1", "d1m2p1", "d1m1p2"] + (["d2m2p1", "d1m2p2", "d4m1p1"] if n >= 4 else [])
    world = 4 if n >= 4 else 2
    rows = [r for per in run_distributed(_realloc_pairs, world, _path(), layouts, runtime_env=detect, timeout=300)
            for r in per]
    assert {(a, b) for a, b, _ in rows} == set(itertools.permutations(layouts, 2))
    bad = [(a, b) for a, b, exact in rows if not exact]
    assert not bad, f"parameters differ after NCCL reallocation: {bad}"


# ------------------------------------------------------------------ flash-attn vs SDPA
def test_flash_attn_logits_match_sdpa():
    if not flash_attn_importable():
        pytest.skip("flash_attn is not installed")
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.real_model import make_packed_input

    path = _path()
    lens = [5, 3, 12, 1, 9]  # unequal lengths: the varlen path, not the equal-length batch
    ids = torch.randint(3, 200, (sum(lens),), generator=torch.Generator().manual_seed(0))
    ref = build_from_hf(path)(ids, make_packed_input(lens)).float()  # fp32 on the CPU
    errs = {}
    for kernel in ("flash", "sdpa"):
        env = _cuda_env(attention=kernel)
        m = build_from_hf(path, env=env)
        assert m.dtype == torch.bfloat16
        out = m(ids.to(env.device), make_packed_input(lens, device=env.device)).float().cpu()
        errs[kernel] = (out - ref).abs().max().item()
    # both kernels compute the same bf16 attention; flash must be as close to the fp32 result as SDPA is (bf16
    # rounding, 2^-9 relative per operation, dominates either error; the margin covers a different order of
    # reduction inside the kernels)
    assert errs["flash"] <= 2 * errs["sdpa"] + 1e-2, errs


# ------------------------------------------------------------------ a bf16 PPO actor step
def _ppo_step(path, runtime_env=None):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from unit.test_head_rows import GROUP_SIZE, _ppo, _sample  # the PPO batch and options of the CPU test

    grid = single_process_grid(runtime_env)
    m = build_from_hf(path, grid=grid, env=runtime_env)  # without an env: fp32 on the CPU
    sample = _sample(m.config.vocab_size)
    sample.data = {k: v.to(m.device) for k, v in sample.data.items()}  # as the data manager stores inputs
    start = m.flat.detach().float().cpu().clone()
    model = Model(name="actor", engine=TrainEngine(m, OptimizerConfig(lr=1e-3), 10), tokenizer=None, grid=grid, path="")
    stats = PPOActorInterface(_ppo(), group_size=GROUP_SIZE, use_critic=False, seed=1).train_step(
        model, sample, MicroBatchSpec(max_tokens_per_mb=20))
    moved = (m.flat.detach().float().cpu() - start).abs().max().item()
    return {"stats": stats, "moved": moved, "dtype": str(m.dtype), "master": str(model.engine.master.dtype)}


def test_bf16_ppo_actor_step():
    path = ensure_tiny_model("qwen2")
    gpu = run_distributed(_ppo_step, 1, path, runtime_env=detect, timeout=300)[0]
    cpu = run_distributed(_ppo_step, 1, path, timeout=300)[0]
    assert gpu["dtype"] == "torch.bfloat16" and gpu["master"] == "torch.float32"
    assert gpu["moved"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in gpu["stats"].values()), gpu
    # the same gradient up to bf16 rounding (2^-9 relative per operation through a few layers)
    g, c = gpu["stats"]["actor_grad_norm"], cpu["stats"]["actor_grad_norm"]
    assert abs(g - c) <= 0.1 * c, (g, c)


# ------------------------------------------------------------------ generation on CUDA
def test_generation_on_cuda_matches_cpu_greedy():
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.nn.real_model import make_packed_input

    path = ensure_tiny_model("qwen2")
    from realhf.impl.model.nn import graph_decode

    g = GenerationHyperparameters(max_new_tokens=16, greedy=True)
    cpu_m = build_from_hf(path)
    cpu = generate(cpu_m, PROMPTS, g)
    before = dict(graph_decode.STATS)
    gpu = generate(build_from_hf(path, dtype=torch.float32, env=_cuda_env()), PROMPTS, g)
    # the decode steps ran as CUDA graphs (graph_decode.py; on by default on CUDA)
    assert graph_decode.STATS["failures"] == before["failures"], "capturing the decode step failed"
    assert graph_decode.STATS["replays"] > before["replays"] and graph_decode.STATS["captures"] > before["captures"]
    bf16 = generate(build_from_hf(path, env=_cuda_env()), PROMPTS, g)
    bf16_eager = generate(build_from_hf(path, env=_cuda_env()), PROMPTS,
                          GenerationHyperparameters(max_new_tokens=16, greedy=True, cuda_graph=False))
    # graphs or not, bf16 on CUDA: the same tokens up to the first near-tie (bf16 logits' rounding is ~1e-2)
    for a, b in zip(bf16.tokens, bf16_eager.tokens):
        assert a[:4] == b[:4], (a, b)
    assert all(1 <= len(t) <= 16 for t in bf16.tokens) and all(torch.isfinite(torch.tensor(lp)).all() for lp in bf16.logprobs)
    # fp32 on both devices: the same tokens until the CPU's two best logits are within 1e-4 of each other
    # (reductions in another order move fp32 logits by ~1e-6 here, far less; closer ties may flip legitimately)
    with torch.no_grad():
        for p, ct, gt, cl, gl in zip(PROMPTS, cpu.tokens, gpu.tokens, cpu.logprobs, gpu.logprobs):
            seq = torch.tensor(p + ct)
            logits = cpu_m(seq, make_packed_input([len(seq)]))[len(p) - 1 : len(seq) - 1]
            top2 = logits.topk(2, -1).values
            close = (top2[:, 0] - top2[:, 1] < 1e-4).nonzero()
            n = int(close[0]) + 1 if close.numel() else len(ct)
            assert gt[:n] == ct[:n], (p, ct, gt)
            assert max(abs(a - b) for a, b in zip(cl[:n], gl[:n])) < 1e-4
