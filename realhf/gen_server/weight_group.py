"""The torch.distributed group of an in-memory weight update: trainer ranks and generation-server ranks.

The group lives beside each process's own default group (a model worker already has one for its model's
parallelism; a server has none): it is built directly from a TCP store, so joining it needs no global
``init_process_group``. Ranks ``0 .. n_senders-1`` are the trainer's (rank 0 hosts the store), the servers'
follow (see :class:`realhf.gen_server.api.WeightGroupSpec`). gloo on CPU, NCCL on GPU.

The trainer broadcasts each tensor of a ``TensorMeta`` list from its ``src`` rank in list order; every
server receives them in the same order (:func:`receive`), so there is no per-tensor handshake.
"""
from __future__ import annotations

import datetime
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from realhf.gen_server.api import RequestError, TensorMeta, WeightGroupSpec


class WeightGroup:
    def __init__(self, spec: WeightGroupSpec, rank: int):
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"weight group {spec.group_name!r}: rank {rank} outside world size {spec.world_size}")
        self.spec, self.rank = spec, rank
        timeout = datetime.timedelta(seconds=spec.timeout_secs)
        self.store = dist.TCPStore(spec.master_addr, int(spec.master_port), spec.world_size, rank == 0,
                                   timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore(f"realhf-weights/{spec.group_name}", self.store)
        if spec.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, rank, spec.world_size, timeout)
        elif spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, rank, spec.world_size, opts)
        else:
            raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {spec.backend!r}")

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = int(src)
        opts.rootTensor = 0
        self.pg.broadcast([t], opts).wait()

    def barrier(self) -> None:
        t = torch.zeros(1, device="cuda" if self.spec.backend == "nccl" else "cpu")
        self.pg.allreduce([t]).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None


def dtype_name(d: torch.dtype) -> str:
    """A dtype as weight updates name it (``float32``): :func:`dtype_of` reads it back."""
    return str(d).replace("torch.", "")


def dtype_of(name) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise RequestError(f"unknown tensor dtype {name!r}")
    return d


def metas_of(named: Dict[str, torch.Tensor], src: int = 0) -> List[TensorMeta]:
    return [TensorMeta(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape), src=src) for n, t in named.items()]


def send(group: WeightGroup, named: Dict[str, torch.Tensor], metas: List[TensorMeta]) -> None:
    """Trainer side: take part in every broadcast of ``metas`` (sending the tensors this rank owns)."""
    for m in metas:
        if m.src == group.rank:
            t = named[m.name].detach().contiguous()
        else:
            t = torch.empty(m.shape, dtype=dtype_of(m.dtype), device=_device(group))
        group.broadcast(t, m.src)


def receive(group: WeightGroup, metas: List[TensorMeta], device=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Server side: yield ``(name, tensor)`` as each broadcast of ``metas`` arrives."""
    dev = device if device is not None else _device(group)
    for m in metas:
        t = torch.empty(m.shape, dtype=dtype_of(m.dtype), device=dev)
        group.broadcast(t, m.src)
        yield m.name, t


def _device(group: WeightGroup):
    return torch.device("cuda", torch.cuda.current_device()) if group.spec.backend == "nccl" else torch.device("cpu")
