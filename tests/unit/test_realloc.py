"""Parameter reallocation between parallel layouts: bit-exact parameters and equal greedy generation.

The plan is checked two ways: in one process, by applying its messages between per-rank buffers of
every ordered pair of layouts (fast, many families); and over 4 real gloo processes, by reallocating a
loaded checkpoint between every ordered pair of seven layouts and comparing parameters bit for bit
with a direct load, and greedy generation with generation on the source layout.
"""
import itertools

import pytest
import torch

from realhf.testing import run_distributed
from realhf.base.topology import ParallelDims, ProcessTopology
from realhf.impl.model.tiny import ensure_tiny_model

LAYOUTS = ["d1m1p1", "d2m1p1", "d1m2p1", "d1m1p2", "d2m2p1", "d1m2p2", "d4m1p1"]
EXTRA = ["d1m1p4", "d2m1p2", "d1m4p1"]


def _paths():
    return {
        "qwen2": ensure_tiny_model("qwen2"),
        "gpt2-tied": ensure_tiny_model("gpt2"),
        "qwen3": ensure_tiny_model("qwen3"),
        # 6 query / 3 kv heads: tp=2 splits the heads unevenly (4 + 2); tied embeddings
        "llama-uneven-heads": ensure_tiny_model("llama", num_attention_heads=6, num_key_value_heads=3,
                                                hidden_size=96, tie_word_embeddings=True),
    }


def _buffers(cfg, layout, seed):
    """Per-rank flat buffers of ``layout`` with the layout-independent random init ``seed``."""
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.parallelism.realloc import _StageView

    topo = ProcessTopology(layout)
    out = {}
    for g in range(layout.world_size):
        c = topo.get_coord(g)
        m = ReaLModel(cfg, grid=_StageView(layout, c.pp, c.tp))
        m.init_random(seed)
        out[g] = m.flat
    return out


def _apply(plan, src, dst):
    """Deliver every message of ``plan`` in one process, through the same pack/unpack as the wire path."""
    from realhf.impl.model.parallelism.realloc import _pack, _unpack

    for m in plan.messages:
        if m.contiguous is not None:
            s, d, n = m.contiguous
            dst[m.dst][d : d + n].copy_(src[m.src][s : s + n])
        else:
            _unpack(_pack(src[m.src], m.src_views, m.numel), dst[m.dst], m.dst_views)


@pytest.mark.parametrize("family", ["qwen2", "gpt2-tied", "qwen3", "llama-uneven-heads", "qwen2-critic"])
def test_plan_moves_every_parameter_bit_exact(family):
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.parallelism.realloc import PlacedLayout, make_plan

    critic = family.endswith("-critic")
    cfg = config_from_hf_path(_paths()[family.replace("-critic", "")], is_critic=critic)
    layouts = []
    for s in LAYOUTS + (EXTRA if family == "qwen2" else []):
        d = ParallelDims.parse(s)
        try:
            cfg.check_layout(d.tp, d.pp)
            layouts.append(d)
        except ValueError:
            pass
    assert len(layouts) >= 7
    cache = {}

    def bufs(d, seed):
        if (d, seed) not in cache:
            cache[(d, seed)] = _buffers(cfg, d, seed)
        return cache[(d, seed)]

    n_pairs = 0
    for a, b in itertools.permutations(layouts, 2):
        plan = make_plan(cfg, PlacedLayout.of(a, range(a.world_size)), PlacedLayout.of(b, range(b.world_size)))
        want = bufs(b, 1)
        dst = {r: t.clone() for r, t in bufs(b, 2).items()}
        _apply(plan, bufs(a, 1), dst)
        for r in dst:
            assert torch.equal(dst[r], want[r]), f"{family}: {a} -> {b}: rank {r} differs after reallocation"
        n_pairs += 1
    assert n_pairs >= 42


def test_plan_prefers_local_copies_and_spreads_load():
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.parallelism.realloc import PlacedLayout, make_plan, stage_param_spec

    cfg = config_from_hf_path(_paths()["qwen2"])
    P = ParallelDims.parse
    # same devices, same layout: everything is a local copy
    same = make_plan(cfg, PlacedLayout.of(P("d2m1p1"), [0, 1]), PlacedLayout.of(P("d2m1p1"), [0, 1]))
    assert same.remote_numel == 0 and all(m.src == m.dst for m in same.messages)
    # a pipeline-only change: each message is one contiguous range of both flat buffers (no packing)
    pp = make_plan(cfg, PlacedLayout.of(P("d1m1p1"), [0]), PlacedLayout.of(P("d1m1p2"), [0, 1]))
    assert all(m.contiguous is not None for m in pp.messages), pp.describe()
    assert {(m.src, m.dst) for m in pp.messages} == {(0, 0), (0, 1)}
    # two source replicas, a tensor-parallel destination on other devices: both replicas send
    tp = make_plan(cfg, PlacedLayout.of(P("d2m1p1"), [0, 1]), PlacedLayout.of(P("d1m2p1"), [2, 3]))
    sent = {}
    for m in tp.messages:
        sent[m.src] = sent.get(m.src, 0) + m.numel
    assert set(sent) == {0, 1} and min(sent.values()) > 0.3 * max(sent.values()), sent
    # every element of the destination arrives exactly once
    n_dst = sum(shape.numel() for t in range(2) for _, shape in stage_param_spec(cfg, P("d1m2p1"), 0, t).values())
    assert tp.total_numel == n_dst


def test_plan_rejects_layouts_the_model_cannot_take():
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.parallelism.realloc import PlacedLayout, make_plan

    cfg = config_from_hf_path(_paths()["llama-uneven-heads"])  # 3 kv heads, 4 layers
    with pytest.raises(ValueError, match="destination layout d1m4p1"):
        make_plan(cfg, PlacedLayout.of(ParallelDims(1, 1, 1), [0]),
                  PlacedLayout.of(ParallelDims(1, 4, 1), [0, 1, 2, 3]))
    with pytest.raises(ValueError, match="needs 2 ranks"):
        PlacedLayout.of(ParallelDims(2, 1, 1), [0])


# --------------------------------------------------------------------------- 4 real processes
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7], [11, 12, 13, 14, 15, 16, 17], [8, 99]]


def _realloc_all_pairs(path, layouts):
    import torch.distributed as dist

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.parallelism.realloc import PlacedLayout, execute_plan, make_plan

    rank = dist.get_rank()
    cfg = config_from_hf_path(path)
    layouts = [ParallelDims.parse(s) for s in layouts]
    grids = [ParallelGrid(d, ranks=list(range(d.world_size))) for d in layouts]  # collective, same order
    loaded = {}
    for d, g in zip(layouts, grids):
        if g.is_member:
            loaded[d] = build_from_hf(path, grid=g)
    # a few greedy tokens: enough to show a model computing with other weights (the flat buffers are also compared
    # bit for bit below); each of the 42 pairs generates on its destination layout
    g0 = GenerationHyperparameters(max_new_tokens=4, greedy=True)
    ref = {d: generate(m, PROMPTS, g0).tokens for d, m in loaded.items()}
    results = []
    for (a, ga), (b, gb) in itertools.permutations(list(zip(layouts, grids)), 2):
        plan = make_plan(cfg, PlacedLayout.of(a, ga.ranks), PlacedLayout.of(b, gb.ranks))
        dst = None
        if gb.is_member:
            dst = ReaLModel(cfg, grid=gb)
            dst.init_random(seed=5)  # anything but the checkpoint
        execute_plan(plan, rank, loaded[a].flat if a in loaded else None, dst.flat if dst is not None else None)
        if dst is not None:
            exact = torch.equal(dst.flat, loaded[b].flat)
            toks = generate(dst, PROMPTS, g0).tokens
            results.append((str(a), str(b), exact, toks == ref[b], toks))
        dist.barrier()
    return results


@pytest.mark.parametrize("family", ["llama-uneven-heads", "gpt2-tied"])
def test_realloc_between_seven_layouts_on_four_processes(family):
    path = _paths()[family]
    layouts = LAYOUTS
    out = run_distributed(_realloc_all_pairs, 4, path, layouts, timeout=300)
    rows = [r for per_rank in out for r in per_rank]
    pairs = {(a, b) for a, b, *_ in rows}
    assert len(pairs) == len(layouts) * (len(layouts) - 1) == 42
    bad = [(a, b) for a, b, exact, *_ in rows if not exact]
    assert not bad, f"{family}: parameters differ after reallocation for {bad[:5]}"
    bad = [(a, b) for a, b, _, same_as_direct_load, _ in rows if not same_as_direct_load]
    assert not bad, f"{family}: greedy generation differs after reallocation for {bad[:5]}"
    # and every layout generates the same tokens as every other one
    assert all(r[4] == rows[0][4] for r in rows)


def test_offload_and_load_back_keep_the_model():
    """Offloading rebinds every parameter to a host copy and frees the device buffer; loading back
    gives the same outputs. (On CPU both copies are host memory; on GPU the host copy is pinned.)"""
    from realhf.api.core.config import OptimizerConfig
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.backend.engine import InferenceEngine, TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.real_model import make_packed_input

    path = _paths()["gpt2-tied"]
    model = build_from_hf(path, grid=single_process_grid())
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    before = model(ids, make_packed_input([6]))
    eng = InferenceEngine(model)
    ptr = model.flat.data_ptr()
    eng.offload()
    assert eng.offloaded and model.flat.data_ptr() != ptr
    assert all(p.data_ptr() >= model.flat.data_ptr() and
               p.data_ptr() < model.flat.data_ptr() + model.flat.numel() * 4 for p in model.parameters())
    eng.load()
    assert not eng.offloaded
    assert torch.equal(model(ids, make_packed_input([6])), before)
    assert model.head.lm_head.weight is model.embed.wte.weight  # the tie survives
    with pytest.raises(RuntimeError, match="cannot be offloaded"):
        TrainEngine(build_from_hf(path, grid=single_process_grid()), OptimizerConfig(), 1).offload()
