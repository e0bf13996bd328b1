"""SharedPrefixCache: the samples of a prompt decode over one copy of its keys/values, and attend exactly as they
would over their own copies (KVCache), also as rows finish and whole prompts leave the batch."""
import torch

from realhf.impl.model.nn.kv_cache import KVCache, SharedPrefixCache

LAYERS, HKV, HQ, D = 2, 3, 9, 16


def _prefilled(plens, max_len):
    g = torch.Generator().manual_seed(1)
    T = int(sum(plens))
    ks = [torch.randn(T, HKV, D, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(T, HKV, D, generator=g) for _ in range(LAYERS)]
    c = KVCache(LAYERS, len(plens), max_len, HKV, D, torch.float32, "cpu")
    c.begin_prefill(torch.tensor(plens))
    for layer in range(LAYERS):
        c.store_prefill(layer, ks[layer], vs[layer])
    c.end_prefill()
    return c


def test_shared_prefix_attention_equals_copied_rows():
    plens, copies = [5, 9, 3, 7], torch.tensor([2, 3, 1, 2])
    ref = _prefilled(plens, 40)
    ref.keep(torch.arange(len(plens)).repeat_interleave(copies))  # one copy of the prompt per sample
    shared = SharedPrefixCache.from_prefill(_prefilled(plens, max(plens) + 1), copies, max_new=12)
    assert shared.pk[0].shape[0] == len(plens), "each prompt's keys must be stored once"
    g = torch.Generator().manual_seed(2)
    # rows finish: one sample of prompt 0 and prompt 2's only sample (so its prefix leaves), later all of prompt 1
    drops = {2: torch.tensor([0, 2, 3, 4, 6, 7]), 5: torch.tensor([0, 4, 5])}
    for step in range(9):
        assert torch.equal(shared.lens, ref.lens), "rows must decode at the same positions"
        B = shared.batch
        q, k, v = (torch.randn(B, h, D, generator=g) for h in (HQ, HKV, HKV))
        for layer in range(LAYERS):
            torch.testing.assert_close(shared.decode_attention(layer, q, k, v, 0.25),
                                       ref.decode_attention(layer, q, k, v, 0.25), rtol=1e-5, atol=1e-5)
        shared.advance()
        ref.advance()
        if step in drops:
            shared.keep(drops[step])
            ref.keep(drops[step])
    assert shared.pk[0].shape[0] == 2, "prefixes no row uses must be dropped"
    assert shared.plens.tolist() == [5, 7]


def test_shared_prefix_overflow_is_reported():
    shared = SharedPrefixCache.from_prefill(_prefilled([4], 5), torch.tensor([2]), max_new=2)
    shared.advance()
    shared.advance()  # room for max_new positions of its own
    try:
        shared.advance()
    except RuntimeError as e:
        assert "overflow" in str(e)
    else:
        raise AssertionError("advancing past max_new must fail")


def test_sharing_pays_from_two_mib_of_keys_and_values_read_again():
    from realhf.impl.model.nn.kv_cache import SHARE_MIN_BYTES, sharing_pays

    # SmolLM2: 3 kv heads of 64, fp32: 1,536 bytes a token per layer for keys and values
    per_token = 2 * 3 * 64 * 4
    assert not sharing_pays([50] * 8, [4] * 8, 3, 64, 4)  # measured 3% slower shared
    assert sharing_pays([150] * 8, [4] * 8, 3, 64, 4)  # measured 1.3x faster attention
    assert not sharing_pays([5000], [1], 3, 64, 4), "one sample reads nothing again"
    edge = -(-SHARE_MIN_BYTES // per_token)  # tokens read again at the threshold
    assert sharing_pays([edge], [2], 3, 64, 4) and not sharing_pays([edge - 1], [2], 3, 64, 4)
