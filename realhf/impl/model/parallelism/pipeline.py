"""Pipeline parallelism: point-to-point transfers between stages and the schedules that use them.

* ``pipeline_forward``: inference over micro-batches. Sends are non-blocking, so stage s works on
  micro-batch i+1 while stage s+1 works on micro-batch i.
* ``pipeline_train_1f1b``: training with the one-forward-one-backward schedule (warm-up forwards,
  a steady phase alternating forward and backward, cool-down backwards), which bounds the number of
  activations a stage keeps to the number of stages.

Every stage knows the token count of every micro-batch (all stages receive the same input metadata),
so receivers allocate their buffers without a shape handshake.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


class StageComm:
    """Sends/receives [tokens, hidden] activations and their gradients to/from neighbouring stages; receive
    buffers are allocated on ``device`` (the model's, from its runtime environment)."""

    def __init__(self, grid, hidden: int, dtype, device):
        self.prev = grid.stage_neighbor(-1)
        self.next = grid.stage_neighbor(+1)
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        self._pending: List[dist.Work] = []

    def _buf(self, n_tokens: int):
        return torch.empty(n_tokens, self.hidden, dtype=self.dtype, device=self.device)

    def recv_forward(self, n_tokens: int) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        t = self._buf(n_tokens)
        dist.recv(t, src=self.prev)
        return t

    def send_forward(self, t: torch.Tensor, blocking: bool = False):
        if self.next is None:
            return
        t = t.detach().contiguous()
        if blocking:
            dist.send(t, dst=self.next)
        else:
            self._pending.append((dist.isend(t, dst=self.next), t))

    def recv_backward(self, n_tokens: int) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        t = self._buf(n_tokens)
        dist.recv(t, src=self.next)
        return t

    def send_backward(self, g: Optional[torch.Tensor]):
        if self.prev is None:
            return
        g = g.contiguous()
        self._pending.append((dist.isend(g, dst=self.prev), g))

    def send_forward_recv_backward(self, y: torch.Tensor, n_tokens: int) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        g = self._buf(n_tokens)
        ops = [dist.P2POp(dist.isend, y.detach().contiguous(), self.next), dist.P2POp(dist.irecv, g, self.next)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return g

    def send_backward_recv_forward(self, g: Optional[torch.Tensor], n_tokens: int) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        x = self._buf(n_tokens)
        ops = [dist.P2POp(dist.isend, g.contiguous(), self.prev), dist.P2POp(dist.irecv, x, self.prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return x

    def flush(self):
        for w, _ in self._pending:
            w.wait()
        self._pending.clear()


def pipeline_forward(
    stage_fn: Callable[[int, Optional[torch.Tensor]], torch.Tensor],
    n_tokens: Sequence[int],
    comm: StageComm,
    is_last: bool,
    post_fn: Optional[Callable[[int, torch.Tensor], Any]] = None,
) -> List[Any]:
    """Run ``stage_fn(mb_index, received_input)`` for every micro-batch through the pipeline.

    Returns, on the last stage, ``post_fn(i, output)`` (or the output) per micro-batch; elsewhere [].
    """
    results = []
    for i, n in enumerate(n_tokens):
        x = comm.recv_forward(n)
        y = stage_fn(i, x)
        if is_last:
            results.append(post_fn(i, y) if post_fn is not None else y)
        else:
            comm.send_forward(y)
    comm.flush()
    return results


def pipeline_train_1f1b(
    stage_fn: Callable[[int, Optional[torch.Tensor]], torch.Tensor],
    loss_fn: Callable[[int, torch.Tensor], torch.Tensor],
    n_tokens: Sequence[int],
    comm: StageComm,
    n_stages: int,
    stage: int,
) -> None:
    """Forward and backward every micro-batch with the 1F1B schedule; gradients accumulate in params.

    ``stage_fn(i, x)`` computes this stage's output for micro-batch i from the received activation
    (None on the first stage). On the last stage ``loss_fn(i, output)`` returns the scalar to
    back-propagate (already weighted so that summing over micro-batches gives the batch loss).
    """
    n_mb = len(n_tokens)
    is_first, is_last = stage == 0, stage == n_stages - 1
    n_warm = min(n_stages - stage - 1, n_mb)
    n_steady = n_mb - n_warm
    saved: List[tuple] = []  # (input requiring grad or None, output) per in-flight micro-batch

    def fwd(i, x):
        if x is not None:
            x.requires_grad_(True)
        y = stage_fn(i, x)
        if is_last:
            y = loss_fn(i, y)
        saved.append((x, y))
        return y

    def bwd(grad_y):
        x, y = saved.pop(0)
        if is_last:
            y.backward()
        else:
            torch.autograd.backward(y, grad_y)
        return None if is_first else x.grad

    fwd_i = 0
    bwd_i = 0
    for _ in range(n_warm):
        x = comm.recv_forward(n_tokens[fwd_i])
        y = fwd(fwd_i, x)
        comm.send_forward(y, blocking=True)
        fwd_i += 1
    x = comm.recv_forward(n_tokens[fwd_i]) if n_steady > 0 else None
    for k in range(n_steady):
        y = fwd(fwd_i, x)
        fwd_i += 1
        grad_y = None if is_last else comm.send_forward_recv_backward(y, n_tokens[bwd_i])
        grad_x = bwd(grad_y)
        last = k == n_steady - 1
        if last:
            comm.send_backward(grad_x)
        else:
            x = comm.send_backward_recv_forward(grad_x, n_tokens[fwd_i]) if not is_first else None
        bwd_i += 1
    for _ in range(n_warm):
        grad_y = comm.recv_backward(n_tokens[bwd_i])
        comm.send_backward(bwd(grad_y))
        bwd_i += 1
    comm.flush()
