"""The CPU GEMM kernel choice (realhf/impl/model/nn/cpu_gemm.py): oneDNN linear against aten's, forward and
backward, the packed weights of generation (and that they never outlive a weight update), the choice by
environment variable, and a tiny model's forward/backward and generation with either kernel."""
import asyncio
import os

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model.nn import cpu_gemm

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture
def kernel():
    """Set the kernel for one test and restore the process's choice afterwards."""
    before = cpu_gemm._choice
    yield cpu_gemm.set_kernel
    cpu_gemm._choice = before


def _grads(fn, x, w, b, gy):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    fn(x, w, b).backward(gy)
    return [None if t is None else t.grad.clone() for t in (x, w, b)]


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), "noncontig"])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_aten_forward_and_backward(kernel, shape, bias):
    kernel("onednn")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 9, generator=g).t() if shape == "noncontig" else torch.randn(*shape, generator=g)
    x.requires_grad_(True)
    w = torch.randn(12, 16, generator=g, requires_grad=True)
    b = torch.randn(12, generator=g, requires_grad=True) if bias else None
    y = cpu_gemm.linear(x, w, b)
    assert y.grad_fn is not None and "OneDNN" in type(y.grad_fn).__name__, "the oneDNN path should have run"
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=g)
    got, want = _grads(cpu_gemm.linear, x, w, b, gy), _grads(F.linear, x, w, b, gy)
    for a, e in zip(got, want):
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    # only what needs a gradient gets one
    w2 = w.detach().requires_grad_(True)
    cpu_gemm.linear(x.detach(), w2).sum().backward()
    assert w2.grad is not None


@needs_onednn
def test_onednn_bf16_and_fallbacks(kernel):
    kernel("onednn")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 32, generator=g), torch.randn(24, 32, generator=g)
    torch.testing.assert_close(cpu_gemm.linear(x.bfloat16(), w.bfloat16()).float(), F.linear(x, w),
                               rtol=3e-2, atol=3e-1)
    # float64 is not a oneDNN type: aten runs it, exactly
    assert torch.equal(cpu_gemm.linear(x.double(), w.double()), F.linear(x.double(), w.double()))


def test_choice_from_environment(kernel, monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "blas")
    with pytest.raises(ValueError, match=r"REALHF_CPU_GEMM='blas'.*allowed: auto, aten, onednn"):
        cpu_gemm.choose()
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "ATEN")
    assert cpu_gemm.choose() == "aten"
    assert kernel(None) == "aten" and cpu_gemm.kernel() == "aten"
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))
    monkeypatch.delenv(cpu_gemm.ENV_VAR)
    assert cpu_gemm.choose() in ("aten", "onednn")  # auto: whichever the probe found faster here
    t = cpu_gemm.probe(m=16, k=64, n=64, reps=2)
    assert set(t) == {"aten", "onednn"} and all(v > 0 for v in t.values())


@needs_onednn
def test_auto_probes_once_per_machine(monkeypatch, tmp_path):
    """The first auto choice on a machine is recorded and every later process uses it without probing, so processes
    of one run (and a resumed run) cannot pick different kernels from timing noise; an existing record wins over a
    later probe."""
    monkeypatch.setenv("REALHF_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    path = cpu_gemm.machine_choice_path()
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    first = cpu_gemm.choose()
    with open(path) as f:
        assert f.read() == first
    other = "aten" if first == "onednn" else "onednn"
    with open(path, "w") as f:
        f.write(other)

    def no_probe(*a, **k):
        raise AssertionError("a recorded choice must not be probed again")

    monkeypatch.setattr(cpu_gemm, "probe", no_probe)
    assert cpu_gemm.choose() == other
    assert cpu_gemm._write_choice(path, first) == other, "the first recorded choice stays"


@needs_onednn
def test_packed_weights_never_outlive_an_update(kernel):
    kernel("onednn")
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(40, 16, generator=g))
    x = torch.randn(32, 16, generator=g)
    with torch.no_grad():
        assert not cpu_gemm._packed
        with cpu_gemm.packed_weights():
            torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
            assert len(cpu_gemm._packed) == 1, "the parameter should have been packed"
            w.mul_(2.0)  # through the parameter: its version moves and the copy is made again
            torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
            w.data.copy_(torch.randn(40, 16, generator=g))  # invisible to the version counter ...
            cpu_gemm.drop_packed()  # ... so an updater drops the copies
            torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
            with cpu_gemm.packed_weights():  # nested: the copies survive the inner exit
                cpu_gemm.linear(x, w)
            assert len(cpu_gemm._packed) == 1
        assert not cpu_gemm._packed, "closing the outermost context drops every copy"


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_linear_group_is_the_layers_one_by_one(kernel, bias):
    """q/k/v (and gate/up) as one product with the packed concatenation of their weights, under packing only;
    the fused copy follows the layers' updates like a single packed weight."""
    kernel("onednn")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, n, bias=bias) for n in (24, 8, 8)]
    x = torch.randn(32, 16)
    with torch.no_grad():
        want = [F.linear(x, m.weight, m.bias) for m in layers]
        outside = cpu_gemm.linear_group(x, layers)
        assert not cpu_gemm._packed, "outside packed_weights the layers run one by one"
        with cpu_gemm.packed_weights():
            got = cpu_gemm.linear_group(x, layers)
            assert [g.shape for g in got] == [w.shape for w in want]
            assert len(cpu_gemm._packed) == 1, "one packed copy for the group"
            for g, w, o in zip(got, want, outside):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
            layers[1].weight.mul_(3.0)  # one member changes: the group is packed again
            got = cpu_gemm.linear_group(x, layers)
            torch.testing.assert_close(got[1], F.linear(x, layers[1].weight, layers[1].bias), rtol=1e-5, atol=1e-5)
    # with autograd the layers run one by one (gradients flow to each)
    out = cpu_gemm.linear_group(x, layers)
    sum(o.sum() for o in out).backward()
    assert all(m.weight.grad is not None for m in layers)


def test_gqa_decode_attention_equals_sdpa():
    from realhf.impl.model.nn.kv_cache import gqa_decode_attention

    torch.manual_seed(0)
    B, hq, hkv, d, L = 5, 6, 2, 8, 11
    q, K, V = torch.randn(B, hq, d), torch.randn(B, hkv, L, d), torch.randn(B, hkv, L, d)
    lens = torch.tensor([0, 3, 10, 7, 1])
    keep = (torch.arange(L)[None] <= lens[:, None])[:, None, None, :]
    add = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    want = F.scaled_dot_product_attention(q.unsqueeze(2), K, V, attn_mask=keep, scale=0.3, enable_gqa=True).squeeze(2)
    torch.testing.assert_close(gqa_decode_attention(q, K, V, add, 0.3), want, rtol=1e-5, atol=1e-5)


def _tiny(path):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    return build_from_hf(path, grid=single_process_grid(), dtype=torch.float32)


@needs_onednn
def test_tiny_model_same_with_either_kernel(kernel):
    """Logits, the gradient of a loss, and greedy generation of a tiny model agree between the kernels."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.impl.model.tiny import ensure_tiny_model

    model = _tiny(ensure_tiny_model("qwen2", tie_word_embeddings=True))
    g = torch.Generator().manual_seed(4)
    lens = [7, 12, 4]
    ids = torch.randint(3, 1000, (sum(lens),), generator=g)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 9)]
    out = {}
    for k in ("aten", "onednn"):
        kernel(k)
        model.zero_grad(set_to_none=True)
        logits = model(ids, make_packed_input(lens))
        torch.log_softmax(logits.float(), -1).mean().backward()
        gen = generate(model, prompts, GenerationHyperparameters(max_new_tokens=12, greedy=True))
        out[k] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, gen)
    (la, ga, gena), (lo, go, geno) = out["aten"], out["onednn"]
    torch.testing.assert_close(lo, la, rtol=1e-4, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(go[n], ga[n], rtol=1e-3, atol=1e-6, msg=f"gradient of {n}")
    assert geno.tokens == gena.tokens
    for a, b in zip(geno.logprobs, gena.logprobs):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_generation_server_serves_new_weights_with_packed_copies(kernel, tmp_path):
    """The gen server keeps packed weight copies across requests: after a weight update from disk (which
    writes the parameters through ReaLModel's flat buffer, invisible to version counters) its greedy tokens
    are the new model's, not the packed old ones."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams
    from realhf.gen_server.realhf_engine import RealhfEngine
    from realhf.impl.model.conversion.hf_io import save_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.tiny import ensure_tiny_model

    kernel("onednn")
    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    new = _tiny(path)
    with torch.no_grad():
        new.flat.add_(torch.randn(new.flat.shape, generator=torch.Generator().manual_seed(5)) * 0.2)
    folder = str(tmp_path / "v1")
    save_hf(new, folder, tokenizer_src=path)
    prompt = list(range(5, 17))
    gh = GenerationHyperparameters(max_new_tokens=16, greedy=True)
    want_old = generate(_tiny(path), [prompt], gh).tokens[0]
    want_new = generate(new, [prompt], gh).tokens[0]
    assert want_old != want_new, "the perturbation should change the greedy answer"

    def req(rid):
        return GenerateRequest(rid=rid, input_ids=prompt,
                               sampling=SamplingParams(greedy=True, max_new_tokens=16).validate())

    async def main():
        e = RealhfEngine(EngineConfig(backend="gen", model_path=path))
        await e.start()
        try:
            old = await e.generate(req("a"))
            await e.update_weights_from_disk(folder, 1)
            return old, await e.generate(req("b"))
        finally:
            await e.close()

    old, got = asyncio.run(main())
    assert old.outputs[0].output_ids == want_old
    assert got.outputs[0].output_ids == want_new
