"""The C++ decode-attention kernel (csrc/decode_attention) against the PyTorch path it replaces on CPU: the same
outputs and the same cache writes, over grouped and plain heads, odd head sizes, rows of every length and the strided
buffers of the generation server's slot cache, over fp32 and fp16 caches; generation with it equals generation
without it; bad input is named; without the kernel the PyTorch path runs after one warning."""
import os
import subprocess
import sys

import pytest
import torch

from realhf.base.process import source_root
from realhf.impl.model.nn import kv_cache
from realhf.impl.model.nn.kv_cache import KVCache, gqa_decode_attention

REPO = source_root()


@pytest.fixture(scope="module")
def kernel():
    """A compiler exists here, so a failed build is a failure with the compiler's message, never a skip."""
    return kv_cache._KERNEL.load(strict=True)


def _torch_step(q, K, V, lens, k, v, scale):
    """The PyTorch path of KVCache.decode_attention, on copies of the buffers: (output, K, V after the writes)."""
    K, V = K.clone(), V.clone()
    rows = torch.arange(q.shape[0])
    K[rows, :, lens] = k
    V[rows, :, lens] = v
    L = int(lens.max()) + 1
    attended = torch.arange(L)[None, :] <= lens[:, None]
    mask = torch.zeros(q.shape[0], 1, 1, L).masked_fill_(~attended[:, None, None, :], float("-inf"))
    return gqa_decode_attention(q, K[:, :, :L], V[:, :, :L], mask, scale), K, V


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512-where-the-cpu-has-it", "portable"])
@pytest.mark.parametrize("B,hq,hkv,d,M", [(6, 9, 3, 64, 50), (4, 4, 4, 8, 10), (3, 6, 2, 48, 33), (2, 2, 1, 20, 7),
                                          (1, 16, 2, 128, 300), (2, 14, 2, 64, 40), (3, 4, 2, 64, 21)])
def test_kernel_equals_the_pytorch_path(kernel, B, hq, hkv, d, M, avx512):
    g = torch.Generator().manual_seed(B * 1000 + d)
    # a slot storage bigger than the batch (the gen server's SlotCache views its first B rows)
    Ks, Vs = torch.randn(B + 3, hkv, M, d, generator=g), torch.randn(B + 3, hkv, M, d, generator=g)
    K, V = Ks[:B], Vs[:B]
    q = torch.randn(B, hq, d, generator=g)
    k, v = torch.randn(B, hkv, d, generator=g), torch.randn(B, hkv, d, generator=g)
    lens = torch.randint(0, M, (B,), generator=g)
    lens[0] = M - 1  # the last position
    if B > 2:
        lens[1] = 0  # a row attending to its new token only
    want, K_want, V_want = _torch_step(q, K, V, lens, k, v, 0.31)
    spare = Ks[B:].clone()
    got = kernel.decode_attention(q, K, V, lens, k, v, 0.31, allow_avx512=avx512)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.equal(K, K_want) and torch.equal(V, V_want), "the new keys/values must land at each row's length"
    assert torch.equal(Ks[B:], spare), "rows outside the batch must not be touched"


def test_kernel_result_does_not_depend_on_threads(kernel):
    g = torch.Generator().manual_seed(3)
    B, hq, hkv, d, M = 8, 9, 3, 64, 70
    K, V = torch.randn(B, hkv, M, d, generator=g), torch.randn(B, hkv, M, d, generator=g)
    q, k, v = torch.randn(B, hq, d, generator=g), torch.randn(B, hkv, d, generator=g), torch.randn(B, hkv, d, generator=g)
    lens = torch.randint(0, M, (B,), generator=g)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.decode_attention(q, K.clone(), V.clone(), lens, k, v, 0.125)
        torch.set_num_threads(2)
        two = kernel.decode_attention(q, K.clone(), V.clone(), lens, k, v, 0.125)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_kernel_names_bad_input(kernel):
    K = torch.zeros(2, 1, 4, 8)
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="row 1 writes position 4 outside the cache of 4 positions"):
        kernel.decode_attention(q, K, K.clone(), torch.tensor([0, 4]), k, k, 1.0)
    with pytest.raises(RuntimeError, match="query heads do not divide"):
        kernel.decode_attention(torch.zeros(2, 3, 8), torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8),
                                torch.tensor([0, 1]), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.decode_attention(q.double(), K, K.clone(), torch.tensor([0, 1]), k, k, 1.0)


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512-where-the-cpu-has-it", "portable"])
@pytest.mark.parametrize("B,hq,hkv,d,M", [(6, 9, 3, 64, 50), (3, 6, 2, 48, 33), (2, 2, 1, 20, 7)])
def test_fp16_cache_is_the_fp32_kernel_on_rounded_keys_and_values(kernel, B, hq, hkv, d, M, avx512):
    """An fp16 cache: the new keys/values are stored rounded to fp16, and the output is the fp32 computation over the
    rounded cache (the arithmetic stays fp32); it differs from the fp32 cache's output by fp16 rounding only."""
    g = torch.Generator().manual_seed(B * 100 + d)
    K, V = torch.randn(B, hkv, M, d, generator=g).half(), torch.randn(B, hkv, M, d, generator=g).half()
    q = torch.randn(B, hq, d, generator=g)
    k, v = torch.randn(B, hkv, d, generator=g), torch.randn(B, hkv, d, generator=g)
    lens = torch.randint(0, M, (B,), generator=g)
    lens[0] = M - 1
    K32, V32 = K.float(), V.float()
    want = kernel.decode_attention(q, K32, V32, lens, k.half().float(), v.half().float(), 0.31, allow_avx512=avx512)
    got = kernel.decode_attention(q, K, V, lens, k, v, 0.31, allow_avx512=avx512)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.equal(K.float(), K32) and torch.equal(V.float(), V32), "the new keys/values, rounded, at each length"
    exact = kernel.decode_attention(q, K32.clone(), V32.clone(), lens, k, v, 0.31)  # unrounded new key/value
    assert (got - exact).abs().max() < 5e-3


def test_fp16_cache_must_be_fp16_throughout(kernel):
    K = torch.zeros(2, 1, 4, 8)
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="same shape, strides and dtype"):
        kernel.decode_attention(q, K.half(), K.clone(), torch.tensor([0, 1]), k, k, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernel.decode_attention(q, K.bfloat16(), K.bfloat16(), torch.tensor([0, 1]), k, k, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
def test_kv_cache_steps_equal_with_and_without_the_kernel(kernel, monkeypatch, dtype):
    """Prefill, decode steps and dropped rows through KVCache: with the kernel and with the PyTorch path."""
    def run():
        g = torch.Generator().manual_seed(5)
        plens = torch.tensor([3, 7, 1, 5])
        c = KVCache(2, 4, 16, 2, 16, dtype, "cpu")
        c.begin_prefill(plens)
        for layer in range(2):
            c.store_prefill(layer, torch.randn(int(plens.sum()), 2, 16, generator=g),
                            torch.randn(int(plens.sum()), 2, 16, generator=g))
        c.end_prefill()
        outs = []
        for step in range(6):
            q, k, v = (torch.randn(c.batch, h, 16, generator=g) for h in (6, 2, 2))
            outs += [c.decode_attention(layer, q, k, v, 0.25) for layer in range(2)]
            c.advance()
            if step == 2:
                c.keep(torch.tensor([0, 1, 3]))
        return outs

    with_kernel = run()
    monkeypatch.setattr(kv_cache, "decode_kernel", lambda: None)
    without = run()
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_generation_without_a_compiler_uses_pytorch_after_one_warning():
    code = (
        "import torch\n"
        "from realhf.impl.model.nn import kv_cache\n"
        "c = kv_cache.KVCache(1, 2, 8, 1, 4, torch.float32, 'cpu')\n"
        "c.begin_prefill(torch.tensor([2, 3])); c.store_prefill(0, torch.ones(5, 1, 4), torch.ones(5, 1, 4)); c.end_prefill()\n"
        "for _ in range(3):\n"
        "    out = c.decode_attention(0, torch.ones(2, 2, 4), torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0), 0.5)\n"
        "    c.advance()\n"
        "print('OK', out.shape)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, REALHF_NO_CPP_EXT="1"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr
    assert p.stderr.count("decode attention C++ extension unavailable (disabled by REALHF_NO_CPP_EXT)") == 1, p.stderr


def _shared_cache(plens, copies, max_new, seed=1, hkv=3, d=16, dtype=torch.float32):
    """A SharedPrefixCache over random prompts' keys/values (2 layers), as generate() builds it after a prefill."""
    g = torch.Generator().manual_seed(seed)
    T = int(sum(plens))
    c = KVCache(2, len(plens), max(plens) + 1, hkv, d, dtype, "cpu")
    c.begin_prefill(torch.tensor(plens))
    for layer in range(2):
        c.store_prefill(layer, torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, d, generator=g))
    c.end_prefill()
    return kv_cache.SharedPrefixCache.from_prefill(c, torch.tensor(copies), max_new=max_new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("d", [16, 20])  # the AVX-512 path where the CPU has it, and the portable one
def test_shared_prefix_kernel_equals_the_pytorch_path(kernel, monkeypatch, d, dtype):
    """Steps over shared prompts with rows finishing (one prompt leaving entirely), with the kernel and without."""
    def run():
        cache = _shared_cache([5, 19, 3, 33], [2, 3, 1, 2], max_new=12, d=d, dtype=dtype)
        g = torch.Generator().manual_seed(2)
        outs = []
        for step in range(10):
            q, k, v = (torch.randn(cache.batch, h, d, generator=g) for h in (9, 3, 3))
            outs += [cache.decode_attention(layer, q, k, v, 0.25) for layer in range(2)]
            cache.advance()
            if step == 3:
                cache.keep(torch.tensor([0, 2, 3, 4, 6, 7]))  # prompt 2's only row leaves
            if step == 6:
                cache.keep(torch.tensor([0, 3, 4, 5]))
        return outs

    with_kernel = run()
    monkeypatch.setattr(kv_cache, "decode_kernel", lambda: None)
    without = run()
    assert len(with_kernel) == len(without) == 20
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_shared_prefix_kernel_names_bad_input(kernel):
    cache = _shared_cache([4, 6], [2, 1], max_new=4)
    q, k = torch.zeros(3, 9, 16), torch.zeros(3, 3, 16)
    args = (q, cache.pk[0], cache.pv[0], cache.plens, cache.k[0], cache.v[0], cache.own, k, k)
    with pytest.raises(RuntimeError, match="row_order must list each of the 3 rows once"):
        kernel.shared_prefix_decode_attention(*args, torch.tensor([0, 0, 2]), torch.tensor([0, 2, 3]), 1.0)
    with pytest.raises(RuntimeError, match="row_starts must run from 0 to 3"):
        kernel.shared_prefix_decode_attention(*args, torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2]), 1.0)
    with pytest.raises(RuntimeError, match=r"^shared_prefix_decode_attention: PK must be a float32 or float16 CPU tensor, got Double"):
        kernel.shared_prefix_decode_attention(q, cache.pk[0].double(), *args[2:], torch.tensor([0, 1, 2]),
                                              torch.tensor([0, 2, 3]), 1.0)
