"""The CUDA-graph decode step (``realhf/impl/model/nn/graph_decode.py``) computes what the eager step computes.

On this CPU machine the decoder runs with ``capture=False``: its "replay" re-executes the step on the buffers a graph
would have been captured on, which checks the buffer handling (static inputs copied in, a new entry when the
cache's buffers change, finished rows left in the batch until at most half still run). The capture itself runs
on a GPU (``tests/gpu/test_gpu_path.py::test_generation_on_cuda_matches_cpu_greedy``, with graphs on by default).
"""
import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.impl.model.conversion.hf_io import build_from_hf
from realhf.impl.model.nn import graph_decode
from realhf.impl.model.nn.generation import generate
from realhf.impl.model.tiny import ensure_tiny_model

PROMPT_LENS = [5, 11, 3, 8, 6, 9, 4, 7]


def _prompts(vocab):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture
def replaying(monkeypatch):
    """generate's graph decoders re-run the step instead of capturing; the decoders made are collected."""
    made = []

    def decoder_for(model):
        d = graph_decode.GraphDecoder(model, capture=False)
        made.append(d)
        return d

    monkeypatch.setattr(graph_decode, "decoder_for", decoder_for)
    return made


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_graph_decode_equals_eager(family, replaying):
    model = build_from_hf(ensure_tiny_model(family))
    prompts = _prompts(model.config.vocab_size)
    cases = [
        dict(max_new_tokens=12, greedy=True),  # sampled inside the step (fold)
        dict(max_new_tokens=12, temperature=0.8, n=2, min_new_tokens=2),  # per-row streams, a ban at first
        dict(max_new_tokens=20, temperature=1.0, top_k=5),  # logits from the step, top-k sampled eagerly
    ]
    for kw in cases:
        seeds = list(range(len(prompts)))
        # stop tokens the model emits at different steps, so rows finish one after another: greedy, three of its
        # tokens; sampled (the ban of stop tokens before min_new_tokens changes what is drawn), every token drawn
        # at steps 3-4 by every third row
        probe = generate(model, prompts, GenerationHyperparameters(cuda_graph=False, **kw), seeds=seeds)
        if kw.get("greedy"):
            stops = sorted({probe.tokens[1][4], probe.tokens[3][2], probe.tokens[5][7]})
        else:
            stops = sorted({t for r in probe.tokens[::3] for t in r[3:5]})
        eager = generate(model, prompts, GenerationHyperparameters(cuda_graph=False, stop_token_ids=tuple(stops), **kw),
                         seeds=seeds)
        n_made = len(replaying)
        graph = generate(model, prompts, GenerationHyperparameters(stop_token_ids=tuple(stops), **kw), seeds=seeds)
        assert len(replaying) == n_made + 1, "generate did not use the graph decoder"
        dec = replaying[-1]
        assert graph.tokens == eager.tokens, f"{family} {kw}: tokens differ"
        assert graph.no_eos == eager.no_eos
        for a, b in zip(graph.logprobs, eager.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), f"{family} {kw}: log-probs differ"
        finished_early = sum(1 for t in eager.tokens if len(t) < kw["max_new_tokens"])
        assert finished_early >= 2, (kw, eager.tokens)
        # every step after the first ran on an entry (replayed); rows finishing did not cost an entry each: a new
        # one only when at most half the rows still ran and the batch was compacted
        assert dec.replays > 0
        rows = len(prompts) * kw.get("n", 1)
        assert 1 <= dec.captures <= rows.bit_length(), (dec.captures, finished_early)


def test_finished_rows_stay_until_half_have_finished(replaying):
    """Rows that stop leave the batch only once at most half still run: until then the cache's buffers (and a
    captured graph on them) are kept."""
    model = build_from_hf(ensure_tiny_model("qwen2"))
    prompts = _prompts(model.config.vocab_size)
    probe = generate(model, prompts, GenerationHyperparameters(max_new_tokens=12, greedy=True, cuda_graph=False))
    # one stop token ending exactly one row early
    first = {}
    for i, t in enumerate(probe.tokens):
        for s, tok in enumerate(t[:-1]):
            first.setdefault(tok, []).append((i, s))
    lone = next(tok for tok, where in first.items() if len({i for i, _ in where}) == 1)
    out = generate(model, prompts, GenerationHyperparameters(max_new_tokens=12, greedy=True, stop_token_ids=(lone,)))
    ref = generate(model, prompts, GenerationHyperparameters(max_new_tokens=12, greedy=True, stop_token_ids=(lone,),
                                                             cuda_graph=False))
    assert out.tokens == ref.tokens
    assert sum(1 for t in out.tokens if len(t) < 12) == 1
    assert replaying[-1].captures == 1  # one of 8 rows finished: the batch was never compacted


def test_a_failed_capture_decodes_eagerly():
    """Where a graph cannot be captured (here: no CUDA at all), the decoder says so once and generate decodes
    eagerly with the same result."""
    model = build_from_hf(ensure_tiny_model("qwen2"))
    prompts = _prompts(model.config.vocab_size)[:3]
    from realhf.impl.model.nn.kv_cache import KVCache

    dec = graph_decode.GraphDecoder(model, capture=True)
    cache = KVCache(model.n_local_layers, 2, 8, model.n_local_kv_heads, model.config.head_dim, model.dtype, "cpu")
    before = graph_decode.STATS["failures"]
    assert dec(torch.tensor([5, 6]), cache) is None and dec.failed
    assert graph_decode.STATS["failures"] == before + 1
    assert dec(torch.tensor([5, 6]), cache) is None  # stays off, no second try
    assert graph_decode.STATS["failures"] == before + 1
    # generate with graphs asked for on the CPU: no decoder is made, the eager step runs
    assert graph_decode.decoder_for(model) is None
    a = generate(model, prompts, GenerationHyperparameters(max_new_tokens=6, greedy=True))
    b = generate(model, prompts, GenerationHyperparameters(max_new_tokens=6, greedy=True, cuda_graph=False))
    assert a.tokens == b.tokens and a.logprobs == b.logprobs


def test_cuda_graph_is_a_sampling_option():
    from realhf.api.quickstart.ppo_config import SamplingConfig
    from realhf.impl.workflow.rlvr import GCONFIG_KEYS

    assert SamplingConfig().to_hyperparameters().cuda_graph is True
    assert SamplingConfig(cuda_graph=False).to_hyperparameters(n=2).cuda_graph is False
    assert "cuda_graph" in GCONFIG_KEYS


def test_padded_rows():
    assert [graph_decode.padded_rows(b, 256) for b in (1, 2, 3, 5, 9, 17, 32, 33, 64, 65, 250)] == \
        [1, 2, 4, 8, 16, 32, 32, 64, 64, 96, 256]
    assert graph_decode.padded_rows(5, 6) == 6 and graph_decode.padded_rows(40, 48) == 48
    for bad in ((0, 8), (9, 8)):
        with pytest.raises(ValueError, match="do not fit"):
            graph_decode.padded_rows(*bad)


def test_padded_decoder_keeps_an_entry_per_row_count_until_the_storage_changes():
    """The gen server's step over its slot cache: rows leaving and coming back reuse the entry (a graph on CUDA) of
    their padded row count; the storage growing drops them all. The logits of the padded step are the eager
    step's."""
    from realhf.gen_server.engine_batch import SlotCache
    from realhf.impl.model.nn.kv_cache import KVCache
    from realhf.impl.model.nn.real_model import PackedInput, make_packed_input

    model = build_from_hf(ensure_tiny_model("qwen2"))
    cfg = model.config
    prompts = _prompts(cfg.vocab_size)[:6]

    def prefilled(ps):
        c = KVCache(model.n_local_layers, len(ps), max(map(len, ps)) + 1, model.n_local_kv_heads, cfg.head_dim,
                    model.dtype, "cpu")
        inp = make_packed_input([len(p) for p in ps])
        inp.cache = c
        c.begin_prefill(torch.tensor([len(p) for p in ps]))
        with torch.no_grad():
            model(torch.tensor([t for p in ps for t in p]), inp)
        c.end_prefill()
        return c

    def cache_of(ps, max_rows=8):
        c = SlotCache(model.n_local_layers, model.n_local_kv_heads, cfg.head_dim, model.dtype, "cpu", max_rows, 64)
        c.add(prefilled(ps), torch.arange(len(ps)), 40)
        return c

    def eager(c, ids):
        inp = PackedInput(cu_seqlens=torch.arange(len(ids) + 1, dtype=torch.int32), max_seqlen=1,
                          position_ids=c.positions().clone(), cache=c)
        with torch.no_grad():
            return model(ids, inp)

    dec = graph_decode.PaddedGraphDecoder(graph_decode.GraphDecoder(model, capture=False))
    a, b = cache_of(prompts[:3]), cache_of(prompts[:3])
    ids = torch.tensor([7, 8, 9])
    with torch.no_grad():
        got = dec(ids, a)
    want = eager(b, ids)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert (dec.captures, dec.padded_steps) == (1, 1)  # 3 rows padded to 4
    a.advance()
    a.remove([0, 2])  # 2 rows: a second entry
    with torch.no_grad():
        dec(torch.tensor([4, 5]), a)
    assert dec.captures == 2
    a.add(prefilled(prompts[3:4]), torch.arange(1), 40)  # 3 rows again, the same storage: the 4-row entry replays
    with torch.no_grad():
        dec(torch.tensor([4, 5, 6]), a)
    assert (dec.captures, dec.replays) == (2, 1)
    a.add(prefilled(prompts[4:6] * 3), torch.arange(6), 40)  # 9 rows: the storage grows, the entries go
    with torch.no_grad():
        out = dec(torch.arange(9) + 3, a)
    assert out.shape[0] == 9 and dec.captures == 3 and len(dec.graphs._entries) == 1
