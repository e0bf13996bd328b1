"""Packed variable-length attention on CPU: sequences of similar length are batched with right padding.
The result and its gradients must equal attending every sequence on its own."""
import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model.nn.attention import length_buckets, varlen_causal_attention


def _per_sequence(q, k, v, lens, scale):
    outs, s = [], 0
    for L in lens:
        if L:
            o = F.scaled_dot_product_attention(*(t[s : s + L].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                               is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
            outs.append(o.squeeze(0).transpose(0, 1))
        s += L
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[34, 35, 36, 38, 37, 34], [5, 100, 7, 0, 99, 3, 50], [3, 0, 3, 4], [200] + [2] * 40,
                                  [9, 9, 9], [1, 64], [60, 60]])
def test_bucketed_attention_equals_per_sequence(lens):
    g = torch.Generator().manual_seed(sum(lens))
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 16, generator=g, requires_grad=True) for h in (6, 2, 2))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    out = varlen_causal_attention(q, k, v, cu, max(lens), 0.25)
    ref = _per_sequence(q, k, v, lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    ga = torch.autograd.grad((out * w).sum(), (q, k, v))
    gb = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_length_buckets_bound_padding():
    lens = [5, 100, 7, 0, 99, 3, 50, 48, 47, 1]
    buckets = length_buckets(lens, slack=1.25)
    members = sorted(i for b in buckets for i in b)
    assert members == [i for i, L in enumerate(lens) if L > 0]  # every non-empty sequence exactly once
    for b in buckets:
        padded = len(b) * max(lens[i] for i in b)
        assert padded <= 1.25 * sum(lens[i] for i in b) or len(b) == 1
    assert len(buckets) < len(members)  # something was batched
