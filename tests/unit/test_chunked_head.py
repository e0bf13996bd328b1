"""Log-probs and entropy from the deferred output head, chunk by chunk: equal to the whole-logits computation (values
and gradients of the hidden states and the head's weight, with temperature, with tensor-parallel vocabulary shards),
and the memory they take bounded by the chunk, not growing with the number of tokens."""
import pytest
import torch

from realhf.base.mem_peak import peak_bytes
from realhf.testing import run_distributed
from realhf.impl.model.nn.chunked_head import HeadOutput, chunk_rows, head_logprobs
from realhf.impl.model.parallelism.tensor_parallel import ColumnParallelLinear


def _reference(h, w, labels, temperature):
    """Whole logits, torch's log-softmax: log-probs of the labels, entropies."""
    logp = torch.log_softmax((h @ w.t()).float() / temperature, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _head(w: torch.Tensor, group=None) -> ColumnParallelLinear:
    head = ColumnParallelLinear(w.shape[1], w.shape[0], False, group, local_out=w.shape[0])
    head.weight.data.copy_(w)
    return head


def _grads(lp, ent, h, w, g1, g2):
    loss = (lp * g1).sum() + (ent * g2).sum()
    return torch.autograd.grad(loss, [h, w])


def _both(head, w0, h0, labels, temperature, chunk, g1, g2):
    """(log-probs, entropies, grad of h, grad of the head's weight) from the chunked head, and from whole logits."""
    h = h0.clone().requires_grad_(True)
    lp, ent = head_logprobs(HeadOutput(h, head), labels, temperature, entropy=True, chunk=chunk)
    chunked = (lp, ent) + _grads(lp, ent, h, head.weight, g1, g2)
    h2, w2 = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    lp2, ent2 = _reference(h2, w2, labels, temperature)
    return chunked, (lp2, ent2) + _grads(lp2, ent2, h2, w2, g1, g2)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
def test_equals_whole_logits(temperature, chunk):
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 40, 24, 301
    w0 = torch.randn(V, H, generator=g)
    h0 = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    g1, g2 = torch.randn(N, generator=g), torch.randn(N, generator=g)

    head = _head(w0)
    chunked, whole = _both(head, w0, h0, labels, temperature, chunk, g1, g2)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b.detach(), atol=2e-5, rtol=1e-5)
    lp2 = whole[0]
    # log-probs alone (no entropy), as the training loss asks for them
    h3 = h0.clone().requires_grad_(True)
    lp3 = head_logprobs(HeadOutput(h3, head), labels, temperature, chunk=chunk)
    (gh3,) = torch.autograd.grad((lp3 * g1).sum(), [h3])
    h4 = h0.clone().requires_grad_(True)
    (gh4,) = torch.autograd.grad((_reference(h4, w0, labels, temperature)[0] * g1).sum(), [h4])
    torch.testing.assert_close(lp3, lp2.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(gh3, gh4, atol=2e-5, rtol=1e-5)


def _tp_worker(chunk, temperature):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    N, H, V = 33, 16, 202
    w0 = torch.randn(V, H, generator=g)
    h0 = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    g1, g2 = torch.randn(N, generator=g), torch.randn(N, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    shard = V // world
    head = _head(w0[rank * shard:(rank + 1) * shard].clone(), group)
    chunked, whole = _both(head, w0, h0, labels, temperature, chunk, g1, g2)
    whole = whole[:3] + (whole[3][rank * shard:(rank + 1) * shard],)  # this rank's slice of the weight's gradient
    return [float((a - b).abs().max()) for a, b in zip(chunked, whole)]


@pytest.mark.parametrize("chunk", [4, 100])  # several chunks; one chunk (the whole-logits path)
def test_tensor_parallel_vocabulary_shards(chunk):
    for diffs in run_distributed(_tp_worker, 2, chunk, 0.8):
        assert max(diffs) < 3e-5, diffs


def _extra_bytes(n_tokens: int, chunk: int, V: int, H: int) -> int:
    """Peak bytes the log-prob pass (forward and backward) allocates above its inputs."""
    g = torch.Generator().manual_seed(0)
    head = _head(torch.randn(V, H, generator=g) * 0.05)
    h = torch.randn(n_tokens, H, generator=g).requires_grad_(True)
    labels = torch.randint(0, V, (n_tokens,), generator=g)

    def work():
        lp, ent = head_logprobs(HeadOutput(h, head), labels, 0.7, entropy=True, chunk=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()

    _, m = peak_bytes(work)
    head.weight.grad = h.grad = None
    return m.peak


def test_memory_bounded_by_the_chunk():
    V, H, chunk = 150_000, 32, 16
    chunk_bytes = chunk * V * 4
    weight_grad = V * H * 4
    small, large = (_extra_bytes(n, chunk, V, H) for n in (128, 512))
    # per token, only O(hidden) numbers stay (the hidden states' gradient, log-probs, log-sum-exp): no [N, V] tensor
    per_token = 4 * (H + 8)
    assert large - small <= (512 - 128) * per_token + chunk_bytes // 4, (small, large)
    # the whole of it: a few chunks of fp32 logits, and the weight's gradient
    assert large <= 4 * chunk_bytes + 2 * weight_grad + 512 * per_token, (large, chunk_bytes)
    # the counter sees [N, V] tensors where they exist: the same 128 tokens in one chunk hold whole logits
    whole = _extra_bytes(128, 128, V, H)
    assert whole >= 2 * 128 * V * 4, whole


def test_chunk_rows_from_the_budget(monkeypatch):
    assert chunk_rows(151_936, 256 << 20) == (256 << 20) // (4 * 151_936)
    assert chunk_rows(151_936) == (1 << 30) // (4 * 151_936)  # the default budget, 1 GiB of fp32 logits
    assert chunk_rows(10**9, 1024) == 1
    monkeypatch.setenv("REALHF_LOGITS_CHUNK_MB", "1")
    assert chunk_rows(1024) == 256
    monkeypatch.setenv("REALHF_LOGITS_CHUNK_MB", "lots")
    with pytest.raises(ValueError, match="REALHF_LOGITS_CHUNK_MB"):
        chunk_rows(1024)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_deferred_head_of_a_model(family, monkeypatch):
    """A model's deferred head (``PackedInput.defer_head``) through the packed log-prob helpers, in chunks of 5 rows:
    the log-probs, entropies and every parameter's gradient equal those of the model's own logits (tied and untied
    output heads)."""
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.impl.model.tiny import ensure_tiny_model
    from realhf.impl.model.utils.functional import logprobs_at, packed_logprobs

    model = build_from_hf(ensure_tiny_model(family))
    vocab = model.config.vocab_size
    model.attach_flat_grad()
    g = torch.Generator().manual_seed(1)
    seqlens = [9, 14, 6]
    ids = torch.randint(0, vocab, (sum(seqlens),), generator=g)
    rows = torch.tensor([2, 3, 4, 10, 11, 12, 13, 20, 21, 24, 25, 26])
    monkeypatch.setenv("REALHF_LOGITS_CHUNK_MB", str(5 * 4 * vocab / (1 << 20)))  # 5 rows a chunk

    def run(defer: bool):
        model.flat_grad.zero_()
        inp = make_packed_input(seqlens)
        inp.defer_head = defer
        out = model(ids, inp)
        lp_all, valid = packed_logprobs(out, ids, inp.cu_seqlens, temperature=0.8)
        inp = make_packed_input(seqlens)
        inp.head_rows, inp.defer_head = rows, defer
        lp, ent = logprobs_at(model(ids, inp), ids, rows, temperature=0.8, entropy=True)
        (lp_all.sum() + (lp * torch.linspace(-1, 1, len(rows))).sum() + 0.3 * ent.sum()).backward()
        return lp_all.detach(), lp.detach(), ent.detach(), model.flat_grad.clone()

    deferred, whole = run(True), run(False)
    assert whole[3].abs().max() > 0
    for a, b in zip(deferred, whole):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)


def test_vocab_shard_logprobs_hold_one_extra_buffer():
    """A rank's log-probs over its vocabulary shard (tensor parallelism, forward-only as in ref_inf/actor_inf) hold at
    most one [rows, V/tp] fp32 buffer beside the logits, as the memory model counts them (logits and one more)."""
    from realhf.impl.model.parallelism.tensor_parallel import _VocabParallelLogProbs

    N, V = 256, 40_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g)
    labels = torch.randint(0, 2 * V, (N,), generator=g)  # half of them on the other (absent) shard
    with torch.no_grad():
        lp, m = peak_bytes(lambda: _VocabParallelLogProbs.apply(logits, labels, None, 0))
    assert m.peak <= N * V * 4 + N * 64, (m.peak, N * V * 4)
    inside = labels < V
    ref = torch.log_softmax(logits, -1).gather(-1, labels.clamp(max=V - 1).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp[inside], ref[inside], atol=1e-5)
