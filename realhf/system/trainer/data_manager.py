"""Data manager: per-worker storage of sample tensors and direct worker-to-worker transfers.

The master keeps only metadata (which worker owns which key of which sample). Before an MFC runs,
it computes a transfer plan (:func:`plan_transfers`): every (sample, key) that a consumer worker
lacks is sent point-to-point from its owner over the model workers' torch.distributed world (the
runtime environment's backend: gloo on CPU, NCCL on GPU). Every worker executes its part of the plan
(:meth:`DataManager.execute`) in plan order with one batch of non-blocking sends/receives, so the pairs
always match. Stored tensors live on the worker's device (``RuntimeEnv.device``): ``put`` moves them
there, so what is sent and what is received are on the same kind of device (one backend serves a batch).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample, str_to_dtype, dtype_to_str
from realhf.base import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class KeyMeta:
    """Enough to allocate a receive buffer for one (sample, key)."""

    seqlens: List[int]
    trailing_shape: Tuple[int, ...]
    dtype: str

    @property
    def numel_rows(self) -> int:
        return sum(self.seqlens)


Transfer = Tuple[int, int, str, str]  # (src worker, dst worker, sample id, key)


def plan_transfers(
    owners: Dict[str, Dict[str, int]], needs: Dict[int, Sequence[str]], keys: Sequence[str]
) -> List[Transfer]:
    """Transfers so that every worker in ``needs`` (worker -> sample ids) holds ``keys`` of its samples.

    ``owners[sample_id][key]`` is the worker holding that tensor. The order is deterministic.
    """
    plan = []
    for dst in sorted(needs):
        for sid in needs[dst]:
            for k in keys:
                src = owners[sid][k]
                if src != dst:
                    plan.append((src, dst, sid, k))
    return plan


class DataManager:
    """Storage of this worker's sample tensors on ``device``: ``store[sample_id][key] -> (tensor, KeyMeta)``."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device
        self.store: Dict[str, Dict[str, Tuple[torch.Tensor, KeyMeta]]] = {}

    # -------------------------------------------------------------- storage
    def put(self, sample: SequenceSample):
        """Store every key of every sample of ``sample`` (which must hold data), on this worker's device."""
        for one in sample.unpack():
            sid = str(one.ids[0])
            slot = self.store.setdefault(sid, {})
            for k in one.keys:
                t = one.data[k].to(self.device)
                slot[k] = (t, KeyMeta(list(one.seqlens[k][0]), tuple(one.trailing_shapes[k]), dtype_to_str(one.dtypes[k])))

    def get(self, ids: Sequence[str], keys: Sequence[str], metadata: Optional[Dict[str, list]] = None) -> SequenceSample:
        """A SequenceSample of ``keys`` for ``ids`` (in that order) from local storage."""
        missing = [(i, k) for i in ids for k in keys if k not in self.store.get(str(i), {})]
        if missing:
            raise KeyError(f"worker {self.rank} lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
        data = {k: torch.cat([self.store[str(i)][k][0] for i in ids]) for k in keys}
        seqlens = {k: [self.store[str(i)][k][1].seqlens for i in ids] for k in keys}
        trailing = {k: self.store[str(ids[0])][k][1].trailing_shape for k in keys}
        dtypes = {k: str_to_dtype(self.store[str(ids[0])][k][1].dtype) for k in keys}
        return SequenceSample(keys=set(keys), ids=list(ids), seqlens=seqlens, trailing_shapes=trailing,
                              dtypes=dtypes, data=data, metadata=metadata or {})

    def meta(self, sid: str, key: str) -> KeyMeta:
        return self.store[str(sid)][key][1]

    def drop(self, ids: Iterable[str]):
        for i in ids:
            self.store.pop(str(i), None)

    def clear(self):
        self.store.clear()

    # -------------------------------------------------------------- transfers
    def execute(self, plan: Sequence[Transfer], metas: Dict[str, Dict[str, dict]]):
        """Run this worker's sends and receives of ``plan``. ``metas[sid][key]`` describes receive buffers."""
        ops = []
        recv: List[Tuple[str, str, torch.Tensor, KeyMeta]] = []
        for src, dst, sid, key in plan:
            if src == self.rank:
                t = self.store[sid][key][0].contiguous()
                ops.append(dist.P2POp(dist.isend, t, dst))
            elif dst == self.rank:
                km = KeyMeta(**metas[sid][key]) if isinstance(metas[sid][key], dict) else metas[sid][key]
                buf = torch.empty((km.numel_rows,) + tuple(km.trailing_shape), dtype=str_to_dtype(km.dtype), device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, src))
                recv.append((sid, key, buf, km))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for sid, key, buf, km in recv:
            self.store.setdefault(sid, {})[key] = (buf, km)
        return len(ops)
