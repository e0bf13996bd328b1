"""Top-p (nucleus) filtering: the kept tokens are the smallest most-probable set whose mass reaches
top_p, found on a growing top-k prefix rather than by sorting the vocabulary."""
import pytest
import torch

from realhf.impl.model.nn.sampling import _top_p_remove, filter_logits


@pytest.mark.parametrize("V,scale", [(7, 1.0), (1000, 0.3), (1000, 3.0), (49152, 1.0), (49152, 8.0)])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_kept_set_is_the_nucleus(V, scale, top_p):
    g = torch.Generator().manual_seed(V + int(100 * top_p))
    logits = torch.randn(8, V, generator=g) * scale
    remove = _top_p_remove(logits, top_p)
    probs = logits.softmax(-1)
    for r in range(8):
        kept = probs[r][~remove[r]]
        dropped = probs[r][remove[r]]
        assert kept.numel() >= 1
        # every kept token is at least as likely as every dropped one
        if dropped.numel():
            assert kept.min() >= dropped.max()
        # the kept mass reaches top_p, and without its least likely token it would not
        assert kept.sum() >= top_p - 1e-5 or dropped.numel() == 0
        assert kept.sum() - kept.min() < top_p + 1e-5


def test_filter_logits_masks_outside_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    assert torch.isinf(filter_logits(logits, 0, 0.75)).tolist() == [[False, False, True, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True, True]]
    assert not torch.isinf(filter_logits(logits, 0, 1.0)).any()
