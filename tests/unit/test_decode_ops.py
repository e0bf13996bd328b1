"""The C++ operations of a decode step (csrc/decode_ops) against the PyTorch operations they replace: the tile GEMM on
every shape class (widths not a multiple of its tile, fewer weight rows than a tile, inner sizes not a multiple of
16, bias, a weight that is a row slice of a wider one), RMSNorm with and without the residual add, rotary embedding in
place on strided views, SiLU(gate) * up; on the AVX-512 path where the CPU has it and on the portable one; the same
result at 1 and 2 threads; bad input named. A model's decode steps and greedy generation with them equal the PyTorch
path; where they do not serve (autograd, many rows, REALHF_DECODE_OPS=0) the PyTorch path runs."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from realhf.base.process import source_root
from realhf.impl.model.nn import decode_ops
from realhf.impl.model.nn.attention import RMSNorm, apply_rotary

REPO = source_root()
PATHS = [True, False]
PATH_IDS = ["avx512-where-the-cpu-has-it", "portable"]


@pytest.fixture(scope="module")
def ops():
    """A compiler exists here, so a failed build is a failure with the compiler's message, never a skip."""
    return decode_ops._KERNEL.load(strict=True)


@pytest.fixture(autouse=True)
def tile_on_every_cpu(monkeypatch):
    """The decode steps take the C++ tile and whole-block paths on every CPU in these tests: production leaves a CPU
    without AVX-512 to the BLAS kernels (the portable tile is slower there), but the paths' results are checked
    everywhere."""
    monkeypatch.setattr(decode_ops, "_tile_kernel_pays", lambda: True)


@pytest.mark.parametrize("avx512", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("M,K,N", [(32, 576, 576), (32, 576, 192), (5, 64, 6), (7, 40, 13), (1, 16, 1), (3, 33, 4),
                                   (64, 128, 100), (4, 576, 1537)])
def test_tile_gemm_equals_f_linear(ops, M, K, N, avx512):
    g = torch.Generator().manual_seed(M * 7 + K + N)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    want = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(ops.skinny_linear(x, w, b, avx512), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.skinny_linear(x, w, None, avx512), want - b, rtol=1e-4, atol=1e-4)


def test_tile_gemm_on_views(ops):
    """A weight that is a slice of a wider one (row stride > K) and an input with a row stride: read in place."""
    g = torch.Generator().manual_seed(1)
    wide, xs = torch.randn(50, 96, generator=g), torch.randn(9, 80, generator=g)
    w, x = wide[3:40, 8:72], xs[:, 16:80]
    assert w.stride(0) == 96 and x.stride(0) == 80
    torch.testing.assert_close(ops.skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_threads(ops):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 576, generator=g), torch.randn(1536, 576, generator=g)
    gate, up = torch.randn(32, 1536, generator=g), torch.randn(32, 1536, generator=g)
    n = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append((ops.skinny_linear(x, w), ops.silu_mul(gate, up), ops.rms_norm(x, w[0].contiguous(), 1e-5)[0]))
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rms_norm_with_and_without_the_residual(ops):
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(12, 576, generator=g), torch.randn(12, 576, generator=g)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    with torch.no_grad():
        (h,) = ops.rms_norm(x, norm.weight, norm.eps)
        torch.testing.assert_close(h, norm(x), rtol=1e-5, atol=1e-5)
        h, s = ops.rms_norm(x, norm.weight, norm.eps, r)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(h, norm(x + r), rtol=1e-5, atol=1e-5)


def test_rotary_in_place_on_strided_views(ops):
    """q and k as the column views of one fused q/k/v product (what linear_group returns), rotated in place."""
    g = torch.Generator().manual_seed(4)
    T, hq, hkv, d = 6, 9, 3, 64
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(T, hq, d), k.reshape(T, hkv, d), v.reshape(T, hkv, d)
    cos, sin = torch.randn(T, 1, d, generator=g), torch.randn(T, 1, d, generator=g)
    want_q, want_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    ops.rotary_(q, k, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before), "v shares the buffer and must not be touched"


@pytest.mark.parametrize("avx512", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("T,I", [(32, 1536), (3, 37)])
def test_silu_mul(ops, T, I, avx512):
    g = torch.Generator().manual_seed(T + I)
    gate, up = torch.randn(T, I, generator=g) * 8, torch.randn(T, I, generator=g)
    gate[0, :4] = torch.tensor([100.0, -100.0, 0.0, 88.5])  # saturated both ways, and zero
    torch.testing.assert_close(ops.silu_mul(gate, up, avx512), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_bad_input_is_named(ops):
    with pytest.raises(RuntimeError, match="x has 8 columns but the weight has 9"):
        ops.skinny_linear(torch.zeros(2, 8), torch.zeros(3, 9))
    with pytest.raises(RuntimeError, match="skinny_linear: x must be a 2-d float32"):
        ops.skinny_linear(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="the bias must be a contiguous float32 CPU vector of 3 values"):
        ops.skinny_linear(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(4))
    with pytest.raises(RuntimeError, match="rms_norm: residual .* and x .* differ in shape"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="rotary_: cos .* must be \\[2, 8\\]"):
        ops.rotary_(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.zeros(2, 6), torch.zeros(2, 6))
    with pytest.raises(RuntimeError, match="silu_mul: gate .* and up .* differ in shape"):
        ops.silu_mul(torch.zeros(2, 8), torch.zeros(2, 7))


def test_where_the_ops_serve(ops):
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    assert decode_ops.for_rows(x) is None, "autograd is on: the PyTorch path"
    with torch.no_grad():
        assert decode_ops.for_rows(x) is ops
        assert decode_ops.for_rows(torch.randn(decode_ops.MAX_ROWS + 1, 32)) is None, "prefill-sized inputs"
        assert decode_ops.for_rows(x.double()) is None
        if ops.has_avx512():
            torch.testing.assert_close(decode_ops.linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert decode_ops.linear(x, w.double(), None) is None


def _decode_logits(model, steps: int = 4, dtype=torch.float32):
    """Logits of a prefill then ``steps`` decode steps of 5 rows over a KV cache (greedy tokens fed back)."""
    from realhf.impl.model.nn.kv_cache import KVCache
    from realhf.impl.model.nn.real_model import PackedInput, make_packed_input

    g = torch.Generator().manual_seed(0)
    plens = [5, 3, 8, 1, 6]
    ids = torch.randint(3, model.config.vocab_size, (sum(plens),), generator=g)
    cache = KVCache(model.n_local_layers, len(plens), 8 + steps + 1, model.n_local_kv_heads, model.config.head_dim,
                    dtype, "cpu")
    cache.begin_prefill(torch.tensor(plens))
    inp = make_packed_input(plens)
    inp.cache = cache
    out = [model(ids, inp)]
    cache.end_prefill()
    tok = out[0][torch.tensor(plens).cumsum(0) - 1].argmax(-1)
    for _ in range(steps):
        inp = PackedInput(cu_seqlens=torch.arange(len(plens) + 1, dtype=torch.int32), max_seqlen=1,
                          position_ids=cache.lens.clone(), cache=cache)
        out.append(model(tok, inp))
        cache.advance()
        tok = out[-1].argmax(-1)
    return out


def test_model_decode_steps_equal_the_pytorch_path(ops, monkeypatch):
    """A tiny Qwen2 (RMSNorm, SiLU-gated MLP, rotary, grouped heads, q/k/v biases): its decode blocks take the C++
    path, and the logits of every step equal those with the ops off."""
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model("qwen2"), grid=single_process_grid())
    assert all(b.decode_fusable for b in model.blocks.values())
    used = []
    pre, whole = real_model._block_pre_decode, real_model._block_decode_whole
    monkeypatch.setattr(real_model, "_BLOCK_DECODE",
                        (lambda *a: used.append(1) or pre(*a), real_model._block_post_decode))
    monkeypatch.setattr(real_model, "_block_decode_whole", lambda *a: _counted(used, whole(*a)))
    stack = real_model._decode_layers_whole
    monkeypatch.setattr(real_model, "_decode_layers_whole", lambda *a: _counted(used, stack(*a)))
    with torch.no_grad():
        fused = _decode_logits(model)
        assert used, "the decode steps did not take the C++ path"
        monkeypatch.setattr(decode_ops, "enabled", lambda: False)
        n = len(used)
        plain = _decode_logits(model)
        assert len(used) == n, "with REALHF_DECODE_OPS off the PyTorch path must run"
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _counted(used, y):
    if y is not None:
        used.append(1)
    return y


def _whole_block_calls(monkeypatch):
    """Counts the layers that take decode_block one call each; the stack of layers in one call (DecodeLayers) is
    turned off, so that they do (it is tested against them below)."""
    from realhf.impl.model.nn import real_model

    calls, whole = [], real_model._block_decode_whole
    monkeypatch.setattr(real_model, "_block_decode_whole", lambda *a: _counted(calls, whole(*a)))
    monkeypatch.setattr(real_model, "_decode_layers_whole", lambda *a: None)
    return calls


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_whole_block_in_one_call_equals_the_op_by_op_path(ops, monkeypatch, family):
    """decode_block (the whole block of a decode step in one C++ call) runs the op-by-op C++ path's functions in its
    order: the logits of every decode step are equal to the bit (Qwen2: q/k/v biases; Llama: none)."""
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model(family), grid=single_process_grid())
    calls = _whole_block_calls(monkeypatch)
    with torch.no_grad():
        whole = _decode_logits(model)
        assert len(calls) == 4 * model.n_local_layers, "every decode step of every layer should take one call"
        monkeypatch.setattr(real_model, "_block_decode_whole", lambda *a: None)
        by_op = _decode_logits(model)
    for a, b in zip(whole, by_op):
        assert torch.equal(a, b)


def test_whole_block_over_shared_prompt_keys_values(ops, monkeypatch):
    """The samples of a prompt decoding over one shared copy of its keys/values (SharedPrefixCache): generation with
    decode_block equals generation with the op-by-op path, tokens and log-probs to the bit. Both on the tile kernel:
    where this process multiplies with oneDNN (cpu_gemm), generation's packed weights would move the op-by-op path's
    products to oneDNN, whose sums are ordered otherwise."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import cpu_gemm, generation, real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model("qwen2"), grid=single_process_grid())
    monkeypatch.setattr(generation, "_share_prefixes", lambda *a: True)
    monkeypatch.setattr(cpu_gemm, "packing", lambda: False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 3)]
    gc = GenerationHyperparameters(max_new_tokens=10, min_new_tokens=10, n=3, temperature=0.9)
    calls = _whole_block_calls(monkeypatch)
    whole = generation.generate(model, prompts, gc, seeds=[1, 2, 3])
    assert len(calls) == 9 * model.n_local_layers
    monkeypatch.setattr(real_model, "_block_decode_whole", lambda *a: None)
    by_op = generation.generate(model, prompts, gc, seeds=[1, 2, 3])
    assert whole.tokens == by_op.tokens and whole.logprobs == by_op.logprobs


def test_whole_block_is_not_used_where_it_cannot_serve(ops, monkeypatch):
    """With the C++ attention off (REALHF_NO_CPP_EXT's effect on kv_cache), or with autograd, no decode_block call,
    neither one per layer nor the stack of layers in one call."""
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import kv_cache, real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model("qwen2"), grid=single_process_grid())
    stack, stacked = real_model._decode_layers_whole, []
    calls = _whole_block_calls(monkeypatch)
    monkeypatch.setattr(real_model, "_decode_layers_whole", lambda *a: _counted(stacked, stack(*a)))
    _decode_logits(model, steps=2)  # autograd on: the PyTorch path
    assert calls == [] and stacked == []
    monkeypatch.setattr(kv_cache, "decode_kernel", lambda: None)
    with torch.no_grad():
        _decode_logits(model, steps=2)
    assert calls == [] and stacked == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_stack_of_layers_in_one_call_equals_one_call_per_layer(ops, monkeypatch, family, dtype):
    """DecodeLayers (every block of a decode step in one C++ call, what ReaLModel.forward takes by default) runs each
    layer as decode_block does: logits equal to the bit. It holds the model's own parameter tensors, so a parameter
    given new storage through ``.data`` (as parameter reallocation does) or updated in place is what it reads next."""
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model(family), grid=single_process_grid())
    stack, stacked = real_model._decode_layers_whole, []
    monkeypatch.setattr(real_model, "_decode_layers_whole", lambda *a: _counted(stacked, stack(*a)))
    with torch.no_grad():
        one_call = _decode_logits(model, dtype=dtype)
        assert len(stacked) == 4, "every decode step should run its layers in one call"
        blk = list(model.blocks.values())[1]
        blk.mlp.up_proj.weight.data = blk.mlp.up_proj.weight.data * 1.5  # new storage for one parameter
        blk.attn.o_proj.weight.mul_(0.5)  # and an update in place
        one_call_new = _decode_logits(model, dtype=dtype)
        calls = _whole_block_calls(monkeypatch)
        per_layer_new = _decode_logits(model, dtype=dtype)
        assert len(calls) == 4 * model.n_local_layers
    for a, b in zip(one_call_new, per_layer_new):
        assert torch.equal(a, b)
    assert not torch.equal(one_call[-1], one_call_new[-1]), "the changed weights should change the logits"


def test_decode_layers_names_bad_input(ops):
    w, n = torch.randn(8, 8), torch.ones(8)
    layer = [n, w, None, w, None, w, None, w, None, n, w, None, w, None, w, None]
    with pytest.raises(RuntimeError, match="layer 0 lacks parameter 3"):
        ops.DecodeLayers([layer[:3] + [None] + layer[4:]], [[1e-6, 1e-6]], scale=1.0, hq=1, hkv=1)
    with pytest.raises(RuntimeError, match="layer 1 needs 16 parameters and 2 eps"):
        ops.DecodeLayers([layer, layer[:-1]], [[1e-6, 1e-6]] * 2, scale=1.0, hq=1, hkv=1)
    dl = ops.DecodeLayers([layer, layer], [[1e-6, 1e-6]] * 2, scale=1.0, hq=1, hkv=1)
    assert dl.n_layers == 2
    K = torch.zeros(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match="2 layers but caches of 1 and 1"):
        dl.run(torch.randn(2, 8), None, None, [K], [K], torch.zeros(2, dtype=torch.long))


def test_decode_block_names_bad_input(ops):
    x = torch.randn(2, 8)
    w = torch.randn(8, 8)
    K = torch.zeros(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match="decode_block: give both cos and sin_signed"):
        ops.decode_block(x, torch.ones(8), 1e-6, w, None, w, None, w, None, w, None, torch.ones(8), 1e-6, w, None, w,
                         None, w, None, torch.ones(2, 8), None, K, K.clone(), torch.zeros(2, dtype=torch.long), 1.0, 1, 1)
    with pytest.raises(RuntimeError, match="decode_block: K must be"):
        ops.decode_block(x, torch.ones(8), 1e-6, w, None, w, None, w, None, w, None, torch.ones(8), 1e-6, w, None, w,
                         None, w, None, None, None, K[0], K[0], torch.zeros(2, dtype=torch.long), 1.0, 1, 1)


def test_greedy_generation_equal_with_the_ops_off():
    """Greedy generation of a tiny Qwen2 with the ops, and in a process with REALHF_DECODE_OPS=0: the same tokens."""
    code = (
        "import torch, json\n"
        "from realhf.api.core.model_api import GenerationHyperparameters\n"
        "from realhf.base.topology import single_process_grid\n"
        "from realhf.impl.model.conversion.hf_io import build_from_hf\n"
        "from realhf.impl.model.nn.generation import generate\n"
        "from realhf.impl.model.tiny import ensure_tiny_model\n"
        "m = build_from_hf(ensure_tiny_model('qwen2'), grid=single_process_grid())\n"
        "g = torch.Generator().manual_seed(3)\n"
        "prompts = [torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist() for n in (4, 9, 2, 7)]\n"
        "out = generate(m, prompts, GenerationHyperparameters(max_new_tokens=12, min_new_tokens=12, greedy=True))\n"
        "print(json.dumps([list(map(int, t)) for t in out.tokens]))\n"
    )
    toks = []
    for flag in ("1", "0"):
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, REALHF_DECODE_OPS=flag),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        toks.append(p.stdout.strip().splitlines()[-1])
    assert toks[0] == toks[1]


def test_a_change_to_an_included_source_rebuilds_the_kernel(tmp_path):
    """decode_ops.cpp compiles decode_attention.cpp into itself: the build flags carry a hash of the shared headers
    and of such included sources, so editing either (not only the main source) makes PyTorch's cache rebuild."""
    from realhf.base.cpp_ext import _headers_flag

    (tmp_path / "common").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "common" / "x.h").write_text("// header\n")
    (tmp_path / "b" / "b.cpp").write_text("// included\n")
    main = tmp_path / "a" / "a.cpp"
    main.write_text('#include "../common/x.h"\n#include "../b/b.cpp"\n')
    first = _headers_flag(str(main))
    (tmp_path / "b" / "b.cpp").write_text("// included, edited\n")
    second = _headers_flag(str(main))
    (tmp_path / "common" / "x.h").write_text("// header, edited\n")
    third = _headers_flag(str(main))
    assert len({tuple(first), tuple(second), tuple(third)}) == 3
    assert _headers_flag(str(main)) == third  # the same files: the same flag


@pytest.mark.parametrize("share", [True, False], ids=["shared-kv", "copied-kv"])
def test_generation_with_the_stack_of_layers_equals_one_call_per_layer(ops, monkeypatch, share):
    """Seeded generation over shared prompt keys/values and over copied ones: tokens and log-probs to the bit with
    DecodeLayers and with one decode_block call per layer."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import generation, real_model
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model("qwen2"), grid=single_process_grid())
    monkeypatch.setattr(generation, "_share_prefixes", lambda *a: share)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 3)]
    gc = GenerationHyperparameters(max_new_tokens=10, min_new_tokens=10, n=3, temperature=0.9)
    stack, stacked = real_model._decode_layers_whole, []
    monkeypatch.setattr(real_model, "_decode_layers_whole", lambda *a: _counted(stacked, stack(*a)))
    one_call = generation.generate(model, prompts, gc, seeds=[1, 2, 3])
    assert len(stacked) == 9
    _whole_block_calls(monkeypatch)
    per_layer = generation.generate(model, prompts, gc, seeds=[1, 2, 3])
    assert one_call.tokens == per_layer.tokens and one_call.logprobs == per_layer.logprobs


def test_greedy_sample_names_bad_input_and_does_not_depend_on_threads(ops):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 49152, generator=g)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.greedy_sample(x, torch.tensor([3]), None)
        torch.set_num_threads(2)
        two = ops.greedy_sample(x, torch.tensor([3]), None)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    with pytest.raises(RuntimeError, match=r"banned token 49152 outside the vocabulary \[0, 49152\)"):
        ops.greedy_sample(x, torch.tensor([49152]), None)
    with pytest.raises(RuntimeError, match="ban must be a bool CPU mask"):
        ops.greedy_sample(x, None, torch.zeros(12, 49152, dtype=torch.bool))
