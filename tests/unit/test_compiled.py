"""Compiled paths equal the eager ones: the decode step (``compile_decode``) and the blocks' parts around
attention (``ReaLModel.compile_blocks``, forward and backward); plain sampling honours banned stop tokens;
per-sequence random streams do not depend on the batch."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base.process import source_root
from realhf.impl.model.conversion.hf_io import build_from_hf
from realhf.impl.model.nn.generation import generate
from realhf.impl.model.nn.sampling import RowStreams, sample_tokens
from realhf.impl.model.tiny import ensure_tiny_model

ROOT = source_root()
PROMPT_LENS = [5, 11, 3, 8, 6, 9]


def _prompts(vocab, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


# compile_decode is opt-in; the default suite compiles the decode step of qwen2 (GQA, rotary), the gpt2 one is slow
# (~75 s on 2 cores); gpt2's compiled blocks stay in the default suite (test_compiled_blocks_equal_eager_...)
@pytest.mark.parametrize("family", ["qwen2", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_compiled_decode_equals_eager(family):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = build_from_hf(ensure_tiny_model(family))
    prompts = _prompts(model.config.vocab_size)
    # a stop token the model emits, so rows finish at different steps and the batch shrinks mid-generation
    probe = generate(model, prompts, GenerationHyperparameters(max_new_tokens=12, greedy=True))
    eos = probe.tokens[1][4]
    cases = [
        dict(max_new_tokens=12, greedy=True),
        dict(max_new_tokens=12, temperature=0.8, n=2, min_new_tokens=2),
        dict(max_new_tokens=70, temperature=1.0, top_p=0.9),  # crosses a RowStreams chunk boundary
    ]
    for kw in cases:
        seeds = list(range(len(prompts)))
        eager = generate(model, prompts, GenerationHyperparameters(**kw), eos_token_id=eos, seeds=seeds)
        comp = generate(model, prompts, GenerationHyperparameters(compile_decode=True, **kw), eos_token_id=eos,
                        seeds=seeds)
        assert model._compiled_decoder.failed is None, model._compiled_decoder.failed
        assert comp.tokens == eager.tokens, f"{family} {kw}: compiled tokens differ"
        assert comp.no_eos == eager.no_eos
        if kw.get("greedy"):
            assert any(eager.no_eos) and not all(eager.no_eos), "rows should both stop early and hit the limit"
        for a, b in zip(comp.logprobs, eager.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), f"{family} {kw}: log-probs differ"
    # the compiled graph really ran (and was reused: one graph for every batch size and cache length)
    assert counters["stats"]["unique_graphs"] >= 1
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])


def test_compile_failure_falls_back_to_eager(tmp_path):
    """With no usable C++ compiler, the compiled step fails once, logs why, and generation decodes eagerly
    with the same result."""
    path = ensure_tiny_model("qwen2")
    code = textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from realhf.api.core.model_api import GenerationHyperparameters
        from realhf.impl.model.conversion.hf_io import build_from_hf
        from realhf.impl.model.nn.generation import generate
        m = build_from_hf({path!r})
        p = [[5, 6, 7, 8], [9, 10, 11]]
        a = generate(m, p, GenerationHyperparameters(max_new_tokens=6, greedy=True))
        b = generate(m, p, GenerationHyperparameters(max_new_tokens=6, greedy=True, compile_decode=True))
        assert m._compiled_decoder.failed, "compiling should have failed"
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
        print("FELL_BACK_OK")
    """)
    # TORCHINDUCTOR_COMPILE_THREADS=1: no pool of compile workers (each a fresh interpreter importing torch) is started
    # for a compile that fails
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
               TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "FELL_BACK_OK" in p.stdout
    assert "compiled step unavailable, running eagerly" in p.stderr


@pytest.mark.slow  # ~45 s on 2 cores: a fresh process compiling the opt-in decode step with a chunked head
def test_decode_step_compiles_before_any_eager_forward(tmp_path):
    """A fresh process whose first forward is the compiled decode step (no CPU GEMM kernel chosen yet) over a
    vocabulary wide enough for the chunked output head: the step compiles (choosing the kernel inside the trace
    would call what dynamo cannot trace) and equals the eager step."""
    path = ensure_tiny_model("qwen2", vocab_size=20000)
    code = textwrap.dedent(f"""
        import torch
        from realhf.impl.model.conversion.hf_io import build_from_hf
        from realhf.impl.model.nn import cpu_gemm
        from realhf.impl.model.nn.compiled_decode import CompiledDecoder
        from realhf.impl.model.nn.kv_cache import KVCache
        from realhf.impl.model.nn.real_model import PackedInput
        m = build_from_hf({path!r})
        assert m.config.vocab_size > 4 * m.head.lm_head.CHUNK_ROWS
        cfg = m.config
        cache = KVCache(cfg.n_layers, 3, 16, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
        cache.lens = torch.tensor([4, 7, 5])
        cache.decoding = True
        ids = torch.tensor([5, 6, 7])
        assert cpu_gemm._choice is None, "nothing ran eagerly yet"
        dec = CompiledDecoder(m)
        with torch.no_grad():
            got = dec(ids, cache)
            assert dec.failed is None, dec.failed
            want = m(ids, PackedInput(cu_seqlens=torch.arange(4, dtype=torch.int32), max_seqlen=1,
                                      position_ids=cache.lens, cache=cache))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print("COMPILED_OK")
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"), PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "COMPILED_OK" in p.stdout


def test_plain_sampling_never_draws_a_banned_token():
    """Sampling without top-k/top-p takes the probabilities from the log-softmax and zeroes banned tokens:
    a banned token carrying most of the mass is never drawn, and the log-probs are those of the unmodified
    distribution."""
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    logits[:, 7] += 6.0  # token 7 holds most of the probability
    banned = torch.tensor([7, 3])
    g = GenerationHyperparameters(temperature=0.7)
    u = torch.rand(64, dtype=torch.float64)
    tok, lp = sample_tokens(logits, g, None, banned, u)
    assert not bool(torch.isin(tok, banned).any())
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-6)
    tok_free, _ = sample_tokens(logits, g, None, None, u)
    assert (tok_free == 7).float().mean() > 0.5, "without the ban, token 7 should dominate"
    # inverse CDF with the same uniforms over the renormalised allowed mass
    p = torch.softmax(logits / 0.7, -1).double()
    p[:, banned] = 0
    cdf = p.cumsum(-1)
    exp = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(tok, exp)


def test_row_streams_do_not_depend_on_the_batch():
    seeds = [3, 1, 4, 1, 5]
    full = RowStreams(seeds)
    part = RowStreams(seeds)
    rows_all = torch.arange(5)
    for step in range(150):  # several chunks
        a = full.uniforms(rows_all, step)
        sub = torch.tensor([4, 1]) if step % 2 else torch.tensor([0, 2, 3])
        b = part.uniforms(sub, step)
        assert torch.equal(a[sub], b)
    # a sequence's stream is its own generator's, in order
    g = torch.Generator().manual_seed(4)
    first = torch.rand(RowStreams.CHUNK, generator=g, dtype=torch.float64)
    fresh = RowStreams(seeds)
    assert torch.equal(torch.stack([fresh.uniforms(torch.tensor([2]), s)[0] for s in range(RowStreams.CHUNK)]), first)
    s = RowStreams(seeds)
    s.uniforms(torch.tensor([0]), 70)
    with pytest.raises(ValueError, match="step 3"):
        s.uniforms(torch.tensor([0]), 3)


# the default suite compiles gpt2's blocks (layer norm, learned positions); qwen2's (~30 s) are slow, qwen2's compiled
# decode step above is in the default suite
@pytest.mark.parametrize("family", [pytest.param("qwen2", marks=pytest.mark.slow), "gpt2"])
def test_compiled_blocks_equal_eager_in_forward_and_backward(family):
    """``compile_blocks``: the same logits (with and without grad) and the same parameter gradients as the
    eager blocks, on packed sequences of unequal lengths (short ones attend through the matmul path, long
    ones through the fused kernel)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    from realhf.impl.model.nn.real_model import compiled_block_fns, make_packed_input

    counters.clear()
    path = ensure_tiny_model(family)
    eager, comp = build_from_hf(path), build_from_hf(path)
    assert comp.compile_blocks() is None
    g = torch.Generator().manual_seed(5)
    for seqlens in ([7, 30, 12, 60, 3], [25, 25, 9]):  # the second batch reuses the compiled graphs
        ids = torch.randint(3, eager.config.vocab_size, (sum(seqlens),), generator=g)
        inp = make_packed_input(seqlens)
        w = torch.randn(sum(seqlens), eager.config.vocab_size, generator=g)
        grads = []
        for m in (eager, comp):
            m.attach_flat_grad()
            m.flat_grad.zero_()
            out = m(ids, inp)
            (out * w).sum().backward()
            grads.append((out.detach(), m.flat_grad.clone()))
            with torch.no_grad():
                grads[-1] += (m(ids, inp),)
        (oe, ge, ie), (oc, gc, ic) = grads
        torch.testing.assert_close(oc, oe, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ic, ie, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gc, ge, atol=1e-4, rtol=1e-4)
        assert float(ge.abs().sum()) > 0
    assert all(f.failed is None for f in compiled_block_fns()), [f.failed for f in compiled_block_fns()]
    assert counters["stats"]["unique_graphs"] >= 2  # pre and post really compiled
