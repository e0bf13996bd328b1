"""Pipelined generation (pp > 1, the batch split into row groups that flow through the stages
round-robin) gives the same sequences as pp == 1 and as the sequential pp > 1 schedule.

One reference process (pp == 1) computes every case; each layout then runs every case with several
numbers of groups in one set of gloo processes, and every rank's output must equal the reference:
greedy tokens and seeded samples token for token, stop flags exactly, log-probs within 1e-5.
"""
import types

import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

PROMPT_LENS = [5, 11, 3, 8, 6, 9, 4]  # 7 prompts: groups of uneven sizes
MAX_NEW = 12
N_SAMPLES = 2  # sampled case: 2 samples per prompt, 14 sequences
BIG = 1000  # a pipeline_groups above the batch size (capped to one row per group)


def _prompts(vocab):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _seeds():
    return [100 + i for i in range(len(PROMPT_LENS))]


def _cases(stop_greedy=(0,), stop_sampled=(0,)):
    """name -> (generation kwargs, eos, use seeds). ``stop_*``: the eos token, then extra stop tokens."""
    return {
        # min == max: every row runs to the end, no early stop
        "greedy": (dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, greedy=True), None, False),
        # rows stop at different steps; some stop tokens are banned at the first steps (min_new_tokens)
        "greedy_eos": (dict(max_new_tokens=MAX_NEW, min_new_tokens=2, greedy=True, stop_token_ids=stop_greedy[1:]),
                       stop_greedy[0], False),
        "sampled_eos": (dict(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, n=N_SAMPLES,
                             stop_token_ids=stop_sampled[1:]), stop_sampled[0], True),
    }


def _run_cases(model, cases, group_counts):
    from realhf.impl.model.nn.generation import generate

    prompts = _prompts(model.config.vocab_size)
    out = {}
    embedded = [0]
    hook = model.embed.register_forward_pre_hook(lambda mod, args: embedded.__setitem__(0, embedded[0] + args[0].numel())) \
        if model.is_first else None
    for name, (gkw, eos, use_seeds) in cases.items():
        for G in group_counts:
            embedded[0] = 0
            o = generate(model, prompts, GenerationHyperparameters(**gkw), eos_token_id=eos,
                         seeds=_seeds() if use_seeds else None, pipeline_groups=G)
            o.embedded = embedded[0] if hook is not None else None  # tokens the first stage took in
            out[name, G] = o
    if hook is not None:
        hook.remove()
    return out


def _expected_prefill_tokens(n_samples, n_seqs, pp, G):
    """Prompt tokens a first stage prefills when each row group prefills each of its distinct prompts once."""
    from realhf.impl.model.nn.generation import split_rows

    n_groups = min(G or pp, n_seqs) if pp > 1 else 1
    return sum(sum(PROMPT_LENS[p] for p in {i // n_samples for i in rows}) for rows in split_rows(n_seqs, n_groups))


def _reference_worker(path):
    """pp == 1: pick stop tokens that some (not all) rows emit early, then run every case."""
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    model = build_from_hf(path, grid=ParallelGrid(ParallelDims(1, 1, 1)))
    prompts = _prompts(model.config.vocab_size)
    probe = generate(model, prompts, GenerationHyperparameters(max_new_tokens=MAX_NEW, greedy=True))
    # tokens 0 of rows 4 and 6 are banned by min_new_tokens=2, which changes those rows' continuations
    stop_greedy = (probe.tokens[2][3], probe.tokens[4][0], probe.tokens[6][0])
    probe = generate(model, prompts, GenerationHyperparameters(**_cases()["sampled_eos"][0]), seeds=_seeds())
    # per-row seeds: rows 0 and 5 sample the same tokens as in the probe until they stop
    stop_sampled = (probe.tokens[0][2], probe.tokens[5][1])
    cases = _cases(stop_greedy, stop_sampled)
    # pipeline_groups is ignored when pp == 1
    return cases, _run_cases(model, cases, [None, 3])


def _layout_worker(path, cases, layouts):
    """Run every case under each ``(layout, group_counts)`` of ``layouts``, each grid on the first ranks of
    the world (one set of processes serves several layouts: spawning is the slow part of these tests)."""
    import torch.distributed as dist

    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    # every rank builds every grid, in the same order (new_group is collective over the world)
    grids = [ParallelGrid(ParallelDims(*layout), ranks=list(range(layout[0] * layout[1] * layout[2])))
             for layout, _ in layouts]
    out = {}
    for grid, (layout, group_counts) in zip(grids, layouts):
        if grid.is_member:
            model = build_from_hf(path, grid=grid)
            out[layout] = _run_cases(model, cases, group_counts)
            # one shared generator, no per-row seeds: samples depend on the schedule, so this is only
            # checked for consistency between the ranks of the replica
            g = GenerationHyperparameters(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, seed=5)
            out[layout, "shared_generator"] = generate(model, _prompts(model.config.vocab_size), g)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def reference():
    path = ensure_tiny_model("llama")
    cases, outs = run_distributed(_reference_worker, 1, path, timeout=120)[0]
    ref = {name: outs[name, None] for name in cases}
    for name in cases:
        o = outs[name, 3]
        assert o.tokens == ref[name].tokens and o.logprobs == ref[name].logprobs, "pp == 1 ignores pipeline_groups"
    # the stop-token cases must cover rows that stop early and rows that run to max_new_tokens
    for name in ("greedy_eos", "sampled_eos"):
        lens = [len(t) for t in ref[name].tokens]
        assert any(not x for x in ref[name].no_eos) and any(ref[name].no_eos), name
        assert min(lens) < MAX_NEW and max(lens) == MAX_NEW, name
        assert sum(not x for x in ref[name].no_eos) >= 2, f"{name}: several rows should stop early"
    assert all(len(t) >= 2 for t in ref["greedy_eos"].tokens), "min_new_tokens not respected"
    assert all(len(t) == MAX_NEW for t in ref["greedy"].tokens)
    return path, cases, ref


def _assert_equal(got, ref, what):
    assert got.tokens == ref.tokens, f"{what}: tokens differ"
    assert got.no_eos == ref.no_eos, f"{what}: no_eos flags differ"
    for i, (a, b) in enumerate(zip(got.logprobs, ref.logprobs)):
        err = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
        assert err < 1e-5, f"{what}: sequence {i} log-probs differ by {err:.3g}"


# Each session is one set of processes running (layout, group counts) pairs. Group counts: None =
# default (pp groups), 1 = the sequential schedule, 3 = more groups than stages, BIG = one row per group
# (groups whose only row stops early leave the schedule).
SESSIONS = {
    "d1m1p2+d1m1p3": [((1, 1, 2), [None, 1, 3, BIG]), ((1, 1, 3), [None, 2])],
    "d1m2p2": [((1, 2, 2), [None, 3])],
}


@pytest.mark.parametrize("session", list(SESSIONS))
def test_pipelined_equals_reference(reference, session):
    path, cases, ref = reference
    layouts = SESSIONS[session]
    world = max(d * t * p for (d, t, p), _ in layouts)
    results = run_distributed(_layout_worker, world, path, cases, layouts, timeout=150)
    for layout, group_counts in layouts:
        label = "d{}m{}p{}".format(*layout)
        ranks = range(layout[0] * layout[1] * layout[2])
        for rank in ranks:  # every rank of the replica returns the full output
            outs = results[rank][layout]
            assert sorted(outs, key=str) == sorted(((n, G) for n in cases for G in group_counts), key=str)
            for (name, G), got in outs.items():
                _assert_equal(got, ref[name], f"{label} rank {rank} {name} pipeline_groups={G}")
                if got.embedded is not None:  # first stage: prompt tokens prefilled = embedded - tokens fed back
                    n = cases[name][0].get("n", 1)
                    prefilled = got.embedded - sum(len(t) - 1 for t in got.tokens)
                    assert prefilled == _expected_prefill_tokens(n, len(got.tokens), layout[2], G), (label, name, G)
            shared = results[rank][layout, "shared_generator"]
            first = results[0][layout, "shared_generator"]
            assert shared.tokens == first.tokens and shared.logprobs == first.logprobs, f"{label} rank {rank}"
            assert all(len(t) == MAX_NEW for t in shared.tokens) and all(x <= 0 for t in shared.logprobs for x in t)


def test_split_rows_and_bad_group_count():
    from realhf.impl.model.nn.generation import generate, split_rows

    assert split_rows(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_rows(4, 4) == [[0], [1], [2], [3]]
    assert sum(split_rows(14, 5), []) == list(range(14))
    fake = types.SimpleNamespace(grid=None)  # validation happens before the model is used
    with pytest.raises(ValueError, match="pipeline_groups"):
        generate(fake, [[1, 2]], GenerationHyperparameters(max_new_tokens=2, greedy=True), pipeline_groups=0)
