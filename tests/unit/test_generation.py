"""Generation: greedy equals transformers under several layouts; sampled log-probs equal a fresh forward."""
import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

PROMPT_LENS = [5, 11, 3, 8, 6]
MAX_NEW = 16


def _prompts(vocab):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _gen_worker(path, layout, gkw, eos):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    grid = ParallelGrid(ParallelDims(*layout))
    model = build_from_hf(path, grid=grid)
    out = generate(model, _prompts(model.config.vocab_size), GenerationHyperparameters(**gkw), eos_token_id=eos)
    return out


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def family_path(request):
    return request.param, ensure_tiny_model(request.param)


def _hf_greedy(path, prompts, eos):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for p in prompts:
        o = m.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["d1m1p1", "d1m2p1", "d1m1p2"])
def test_greedy_equals_transformers(family_path, layout):
    fam, path = family_path
    # a stop token that the model actually emits, so early stopping and batch compaction are exercised
    probe = run_distributed(_gen_worker, 1, path, (1, 1, 1), dict(max_new_tokens=MAX_NEW, greedy=True), None)[0]
    eos = probe.tokens[2][3]
    world = layout[0] * layout[1] * layout[2]
    outs = run_distributed(_gen_worker, world, path, layout, dict(max_new_tokens=MAX_NEW, greedy=True), eos,
                           timeout=240)
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    ref = _hf_greedy(path, _prompts(vocab), eos)
    for r in outs:  # every rank of the replica returns the same tokens
        assert r.tokens == ref, f"{fam} {layout}: greedy tokens differ from transformers"
    assert any(not x for x in outs[0].no_eos) and any(outs[0].no_eos), "test should cover both stop and length limit"
    for toks, ne in zip(outs[0].tokens, outs[0].no_eos):
        assert (toks[-1] == eos) != ne and len(toks) <= MAX_NEW


def test_sampled_logprobs_match_forward_and_seed_reproducible():
    from realhf.impl.model.utils.functional import packed_logprobs

    path = ensure_tiny_model("llama")
    gkw = dict(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, top_k=50, seed=3, min_new_tokens=4)
    a = run_distributed(_gen_worker, 2, path, (1, 2, 1), gkw, 2)
    b = run_distributed(_gen_worker, 1, path, (1, 1, 1), gkw, 2)[0]
    assert a[0].tokens == a[1].tokens == b.tokens, "same seed must give the same samples in every layout"
    assert all(len(t) >= 4 for t in b.tokens), "min_new_tokens not respected"
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts(m.config.vocab_size)
    for p, toks, lps in zip(prompts, b.tokens, b.logprobs):
        seq = torch.tensor(p + toks)
        with torch.no_grad():
            logits = m(seq[None]).logits[0]
        cu = torch.tensor([0, len(seq)], dtype=torch.int32)
        fresh, _ = packed_logprobs(logits, seq, cu)
        fresh = fresh[len(p) - 1 : len(seq) - 1]
        err = (fresh - torch.tensor(lps)).abs().max().item()
        assert err < 1e-4, f"generation log-probs differ from a fresh forward by {err:.3g}"
    c = run_distributed(_gen_worker, 1, path, (1, 1, 1), dict(gkw, seed=4), 2)[0]
    assert c.tokens != b.tokens, "a different seed should give different samples"


@pytest.mark.parametrize("share", [True, False], ids=["shared-kv", "copied-kv"])
def test_fp16_kv_cache_logprobs_are_a_fresh_forward_to_fp16_rounding(share, monkeypatch):
    """kv_cache_dtype="float16" (fp32 model): seeded samples whose log-probs equal a fresh fp32 forward of the sampled
    sequence to within fp16 rounding of the cached keys/values, and the cache really holds fp16 (the C++ kernel's
    path here; the PyTorch path is tested against it in test_decode_attention)."""
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import generation, kv_cache
    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.impl.model.utils.functional import packed_logprobs

    path = ensure_tiny_model("qwen2")
    model = build_from_hf(path, grid=single_process_grid())
    monkeypatch.setattr(generation, "_share_prefixes", lambda *a: share)
    seen = []
    init = kv_cache.KVCache.__init__
    monkeypatch.setattr(kv_cache.KVCache, "__init__", lambda self, *a: seen.append(a[5]) or init(self, *a))
    prompts = _prompts(model.config.vocab_size)
    gc = GenerationHyperparameters(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, n=2, kv_cache_dtype="float16")
    out = generation.generate(model, prompts, gc, seeds=list(range(len(prompts))))
    assert seen == [torch.float16]
    errs = []
    with torch.no_grad():
        for i, (toks, lps) in enumerate(zip(out.tokens, out.logprobs)):
            p = prompts[i // 2]
            seq = torch.tensor(p + toks)
            logits = model(seq, make_packed_input([len(seq)]))
            fresh, _ = packed_logprobs(logits, seq, torch.tensor([0, len(seq)], dtype=torch.int32))
            errs.append((fresh[len(p) - 1:len(seq) - 1] - torch.tensor(lps)).abs().max().item())
    assert max(errs) < 5e-3, f"fp16-cache log-probs differ from a fresh fp32 forward by {max(errs):.3g}"
    assert max(errs) > 0, "an fp16 cache rounds the keys/values; exactly equal log-probs mean it was not used"


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16, got 'bfloat16'"):
        GenerationHyperparameters(kv_cache_dtype="bfloat16")


@pytest.mark.parametrize("share", [True, False], ids=["shared-kv", "copied-kv"])
def test_samples_of_a_prompt_share_its_prefill(share, monkeypatch):
    """With n samples per prompt the prompt is prefilled once, and its samples decode over one shared copy of its
    keys/values (SharedPrefixCache, where sharing pays: forced here) or over copies of its cache row: greedy samples
    equal one greedy run per prompt, and sampled log-probs equal a fresh forward pass."""
    import transformers

    from realhf.impl.model.nn import kv_cache

    monkeypatch.setattr(kv_cache, "SHARE_MIN_BYTES", 0 if share else 2**62)
    made = []
    real = kv_cache.SharedPrefixCache.from_prefill.__func__
    monkeypatch.setattr(kv_cache.SharedPrefixCache, "from_prefill",
                        classmethod(lambda cls, *a, **k: made.append(1) or real(cls, *a, **k)))

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.utils.functional import packed_logprobs

    path = ensure_tiny_model("qwen2")
    model = build_from_hf(path, grid=single_process_grid(), dtype=torch.float32)
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts(m.config.vocab_size)
    one = generate(model, prompts, GenerationHyperparameters(max_new_tokens=8, greedy=True))
    three = generate(model, prompts, GenerationHyperparameters(max_new_tokens=8, greedy=True, n=3))
    assert three.tokens == [t for t in one.tokens for _ in range(3)]
    s = generate(model, prompts, GenerationHyperparameters(max_new_tokens=8, temperature=1.0, n=4),
                 seeds=list(range(len(prompts))))
    assert len({tuple(t) for t in s.tokens[:4]}) > 1, "the samples of one prompt should differ"
    for i, (toks, lps) in enumerate(zip(s.tokens, s.logprobs)):
        p = prompts[i // 4]
        seq = torch.tensor(p + toks)
        with torch.no_grad():
            logits = m(seq[None]).logits[0]
        fresh, _ = packed_logprobs(logits, seq, torch.tensor([0, len(seq)], dtype=torch.int32))
        err = (fresh[len(p) - 1 : len(seq) - 1] - torch.tensor(lps)).abs().max().item()
        assert err < 1e-4, f"sample {i}: log-probs differ from a fresh forward by {err:.3g}"
    assert bool(made) == share, "the shared-prefix cache should be used exactly when sharing pays"


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_greedy_tokens_equal_the_log_softmax_form(path, monkeypatch):
    """The greedy sampler (C++ greedy_sample for a decode step's rows, else two PyTorch passes): the same tokens as an
    argmax over the banned-masked logits, log-probs of the unmodified distribution within float rounding, banned ids
    never chosen (even where one is the row's maximum, or ties with an allowed one), and the caller's logits left as
    they were."""
    from realhf.impl.model.nn import decode_ops
    from realhf.impl.model.nn.sampling import greedy_tokens

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[0, 7] = 100.0  # a banned id is the row's maximum
    logits[1, 11] = logits[1, 12] = 60.0  # equal maxima: the first wins
    logits[2, 5] = logits[2, 250] = 80.0  # an allowed maximum before a banned one
    logits[3, 250] = logits[3, 260] = 80.0  # a banned maximum before an allowed one
    banned = torch.tensor([7, 250])
    if path == "torch":
        monkeypatch.setattr(decode_ops, "enabled", lambda: False)
    torch.set_grad_enabled(False)  # a decode step's state (the C++ path serves no autograd)
    try:
        assert (decode_ops.for_rows(logits) is not None) == (path == "cpp")
        _check_greedy(logits, banned, greedy_tokens)
    finally:
        torch.set_grad_enabled(True)


def _check_greedy(logits, banned, greedy_tokens):
    mask = torch.zeros(300, dtype=torch.bool)
    mask[banned] = True
    before = logits.clone()
    ref_lp = torch.log_softmax(logits, -1)
    ref_tok = logits.masked_fill(mask, float("-inf")).argmax(-1)
    for tok, lp in (greedy_tokens(logits, banned), greedy_tokens(logits, ban=mask),
                    greedy_tokens(logits, ban=mask.expand(6, 300))):
        assert torch.equal(logits, before)
        assert torch.equal(tok, ref_tok) and tok[0] != 7 and tok[1] == 11
        torch.testing.assert_close(lp, ref_lp.gather(-1, tok[:, None]).squeeze(-1), rtol=0, atol=1e-5)
    assert tok[2] == 5 and tok[3] == 260
    tok, lp = greedy_tokens(logits)
    assert tok[0] == 7 and torch.allclose(lp[0], ref_lp[0, 7], atol=1e-5)


@pytest.mark.parametrize("B,V", [(32, 49152), (7, 1000), (3, 5), (4, 513)])
def test_inverse_cdf_equals_the_whole_vocabulary_cumulative_sum(B, V):
    """The two-level inverse CDF picks the token a float64 cumulative sum over the whole vocabulary picks, and never
    a zero-weight token (weights with plateaus of zeros, vocabularies that are not a multiple of the block)."""
    from realhf.impl.model.nn.sampling import inverse_cdf

    g = torch.Generator().manual_seed(B * V)
    for _ in range(5):
        w = torch.rand(B, V, generator=g) ** 8
        w[:, ::7] = 0
        u = torch.rand(B, dtype=torch.float64, generator=g)
        cdf = w.double().cumsum(-1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp(max=V - 1)
        got = inverse_cdf(w, u)
        assert torch.equal(got, ref)
        assert (w.gather(-1, got[:, None]) > 0).all()
    # the end of the range: u just below 1 lands on the last nonzero token
    w = torch.zeros(2, V)
    w[:, 0] = 1.0
    w[:, V - 1 if V > 1 else 0] = 1.0
    assert inverse_cdf(w, torch.tensor([0.999999, 0.0], dtype=torch.float64)).tolist() == [V - 1, 0]
