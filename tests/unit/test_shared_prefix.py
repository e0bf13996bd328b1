"""A prompt shared by adjacent sequences is computed once (``realhf.impl.model.nn.shared_prefix``): attention over the
compact tree equals each sequence's own causal attention; a model's outputs and gradients equal the plain layout's
(GQA with rotary, learned positions), also under tensor and pipeline parallelism through the engines; and the layout
changes only where a prefix worth sharing is found."""
import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model.nn import shared_prefix
from realhf.impl.model.nn.shared_prefix import share_prefixes, tree_attention
from realhf.testing import run_distributed


def _grouped(vocab, groups, seed=0, extra=(17,)):
    """Packed ids of prompts (lengths) each followed by answers (lengths), then unshared sequences ``extra``."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for P, answers in groups:
        p = torch.randint(3, vocab, (P,), generator=g)
        seqs += [torch.cat([p, torch.randint(3, vocab, (A,), generator=g)]) for A in answers]
    seqs += [torch.randint(3, vocab, (L,), generator=g) for L in extra]
    return torch.cat(seqs), [len(s) for s in seqs]


GROUPS = [(20, [5, 11, 1, 60]), (9, [3, 40]), (70, [2, 2, 90, 30])]


def test_tree_attention_equals_each_sequence_attending_alone():
    ids, lens = _grouped(1000, GROUPS)
    compact, pos, tree = share_prefixes(ids, lens)
    assert compact.numel() == ids.numel() - (3 * 20 + 9 + 3 * 70)  # each prompt once
    assert shared_prefix.segment_lengths(ids, lens) == tree.q_lens  # the memory model's view of the same layout
    torch.testing.assert_close(compact[tree.expand], ids, rtol=0, atol=0)  # the layout maps back token for token
    g = torch.Generator().manual_seed(1)
    R = compact.numel()
    q, k, v = (torch.randn(R, h, 16, generator=g, requires_grad=True) for h in (6, 2, 2))
    out = tree_attention(q, k, v, tree, 0.25)
    # reference: every original sequence alone, its rows read through the expansion (a prefix's rows are shared)
    refs, s = [], 0
    for L in lens:
        rows = tree.expand[s:s + L]
        o = F.scaled_dot_product_attention(*(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                           is_causal=True, scale=0.25, enable_gqa=True)
        refs.append(o.squeeze(0).transpose(0, 1))
        s += L
    ref = torch.cat(refs)
    torch.testing.assert_close(out[tree.expand], ref, atol=1e-5, rtol=1e-5)
    # gradients: the plain layout's loss over every original token (a prefix row counted once per member)
    w = torch.randn(ref.shape, generator=g)
    ga = torch.autograd.grad((out[tree.expand] * w).sum(), (q, k, v))
    gb = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert pos.tolist()[:20] == list(range(20)) and pos.tolist()[20:25] == list(range(20, 25))


def test_layout_changes_only_where_a_prefix_is_worth_sharing():
    # nothing in common: the plain layout
    ids, lens = _grouped(1000, [], extra=(30, 40, 50))
    assert share_prefixes(ids, lens) is None and shared_prefix.segment_lengths(ids, lens) == lens
    # a common prefix shorter than MIN_PREFIX is not shared
    ids, lens = _grouped(1000, [(shared_prefix.MIN_PREFIX - 1, [50, 50, 50])], extra=())
    assert share_prefixes(ids, lens) is None
    # a saving under MIN_SAVING of the tokens leaves the layout as it is
    ids, lens = _grouped(1000, [(10, [5, 5])], extra=(400,))
    assert share_prefixes(ids, lens) is None
    # identical sequences: each keeps its last token of its own (every member has a query segment)
    seq = torch.arange(3, 43)
    compact, pos, tree = share_prefixes(torch.cat([seq, seq, seq]), [40, 40, 40])
    assert compact.numel() == 39 + 3 and tree.q_lens == [39, 1, 1, 1] and tree.k_lens == [39, 40, 40, 40]
    # one sequence alone is never rearranged
    assert share_prefixes(seq, [40]) is None


def _model(family):
    from realhf.impl.model.conversion.hf_io import config_from_hf_path
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.impl.model.tiny import ensure_tiny_model

    m = ReaLModel(config_from_hf_path(ensure_tiny_model(family)), dtype=torch.float32)
    m.init_random(seed=0)
    m.attach_flat_grad()
    return m


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_model_outputs_and_gradients_equal_the_plain_layout(family):
    from realhf.impl.model.nn.real_model import packed_model_input

    m = _model(family)
    ids, lens = _grouped(m.config.vocab_size, GROUPS, seed=2)
    rows = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))[:60]
    res = []
    for share in (False, True):
        m.flat_grad.zero_()
        x, inp = packed_model_input(ids, lens, share=share)
        inp.head_rows = rows
        out = m(x, inp)
        out.float().logsumexp(-1).sum().backward()
        res.append((x.numel(), out.detach(), m.flat_grad.clone()))
    (n_plain, out_plain, grad_plain), (n_shared, out_shared, grad_shared) = res
    assert n_shared < 0.7 * n_plain
    torch.testing.assert_close(out_shared, out_plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_shared, grad_plain, atol=2e-5, rtol=1e-4)


def _engines_worker(layout):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.data_api import SequenceSample
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp
    from realhf.impl.model.tiny import ensure_tiny_model

    grid = ParallelGrid(ParallelDims(*layout))
    out = {}
    for share in (False, True):
        model = build_from_hf(ensure_tiny_model("qwen2"), grid=grid)
        engine = TrainEngine(model, OptimizerConfig(lr=1e-3), 10)
        engine.share_prefixes = share
        ids, lens = _grouped(model.config.vocab_size, GROUPS, seed=4)
        # one sample per prompt with its answers, as a GRPO batch holds them
        per, i = [], 0
        for _, answers in GROUPS:
            per.append(lens[i:i + len(answers)])
            i += len(answers)
        per.append(lens[i:])
        sample = SequenceSample(keys={"packed_input_ids"}, ids=list(range(len(per))),
                                seqlens={"packed_input_ids": per}, trailing_shapes={"packed_input_ids": ()},
                                dtypes={"packed_input_ids": ids.dtype}, data={"packed_input_ids": ids})
        logits = engine.forward(sample, n_mbs=2, post_fn=lambda y, mb: gather_from_tp(y, model.tp_group))

        def loss_fn(y, mb):
            return gather_from_tp(y, model.tp_group).float().logsumexp(-1).mean(), {}

        st = engine.train_batch(sample, loss_fn, lambda mb: float(mb.data["packed_input_ids"].numel()), n_mbs=2)
        # the step's gradient (AdamW's first update is about lr * sign(gradient): it would magnify rounding)
        out[share] = (None if logits is None else torch.cat(logits), model.flat_grad.clone(), st.loss)
    return out


@pytest.mark.parametrize("layout", [(1, 2, 1), (1, 1, 2)])
def test_engines_agree_under_tensor_and_pipeline_parallelism(layout):
    """Forward passes and a training step through the engines, with and without sharing, in 2 micro-batches."""
    for rank_out in run_distributed(_engines_worker, 2, layout):
        (lp, grad_plain, loss_plain), (ls, grad_shared, loss_shared) = rank_out[False], rank_out[True]
        if lp is not None:
            torch.testing.assert_close(ls, lp, atol=5e-5, rtol=1e-4)
        assert abs(loss_shared - loss_plain) < 1e-5 * abs(loss_plain)
        assert grad_plain.abs().max() > 0
        torch.testing.assert_close(grad_shared, grad_plain, atol=1e-5, rtol=1e-4)
