"""The CUDA-graph decode step (``realhf/impl/model/nn/graph_decode.py``) computes what the eager step computes.

On this CPU machine the decoder runs with ``capture=False``: its "replay" re-executes the step on the buffers a graph
would have been captured on, which checks the buffer handling (static inputs copied in, a new entry when the
cache's buffers change, finished rows left in the batch until at most half still run). The capture itself runs
on a GPU (``tests/test_gpu_path.py::test_generation_on_cuda_matches_cpu_greedy``, with graphs on by default).
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
