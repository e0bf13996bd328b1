"""The master's buffer: metadata of every sample in flight — never tensors.

Per sample id it knows which worker owns each key and the metadata needed to receive it (sequence lengths,
trailing shape, dtype), the sample's plain metadata (``query_id``, ...), its cost for data-parallel
balancing, and its *birth*: the global step at which it entered the buffer and, per key, the parameter
version of the model that produced it (``None`` for dataset keys). The buffer outlives a step: samples
stay until :meth:`SampleBuffer.drop` removes them, so a stream of finished trajectories can feed it the same
way the dataset does. Thread-safe: MFCs of one step add their outputs concurrently.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Iterable, List, Optional, Sequence

from realhf.api.core.data_api import SequenceSample


@dataclasses.dataclass
class Birth:
    step: int  # the global step at which the sample entered the buffer
    versions: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)  # key -> producing model's version


class SampleBuffer:
    def __init__(self):
        self.owners: Dict[str, Dict[str, int]] = {}  # sample id -> key -> worker rank
        self.metas: Dict[str, Dict[str, dict]] = {}  # sample id -> key -> receive metadata (data_manager.KeyMeta)
        self.metadata: Dict[str, dict] = {}  # sample id -> plain metadata
        self.tokens: Dict[str, int] = {}  # sample id -> cost for data-parallel balancing
        self.births: Dict[str, Birth] = {}
        self.lock = threading.Lock()

    def add(self, header: dict, owner: int, step: int, version: Optional[int] = None) -> List[str]:
        """Record the samples of a ``SequenceSample`` wire header held by worker ``owner``: new samples are born at
        ``step``; their keys were produced by a model at parameter ``version`` (None: from the dataset). Returns the
        sample ids."""
        s = SequenceSample.from_wire(header, [])
        ids = [str(i) for i in s.ids]
        with self.lock:
            for i, sid in enumerate(ids):
                birth = self.births.setdefault(sid, Birth(step))
                for k in s.keys:
                    self.owners.setdefault(sid, {})[k] = owner
                    self.metas.setdefault(sid, {})[k] = {
                        "seqlens": list(s.seqlens[k][i]), "trailing_shape": list(s.trailing_shapes[k]),
                        "dtype": str(s.dtypes[k]).replace("torch.", ""),
                    }
                    birth.versions[k] = version
                md = self.metadata.setdefault(sid, {})
                for k, v in s.metadata.items():
                    md[k] = v[i]
                # the cost of a sample for data-parallel balancing: its longest-known sequences
                if sid not in self.tokens or "packed_input_ids" in s.keys:
                    self.tokens[sid] = sum(s.seqlens[s.main_key()][i])
        return ids

    def ids(self) -> List[str]:
        with self.lock:
            return list(self.owners)

    def has(self, ids: Sequence[str], keys: Iterable[str]) -> bool:
        """Whether every sample of ``ids`` holds every key of ``keys``."""
        keys = list(keys)
        with self.lock:
            return all(sid in self.owners and all(k in self.owners[sid] for k in keys) for sid in ids)

    def missing(self, ids: Sequence[str], keys: Iterable[str]) -> List[str]:
        """The keys of ``keys`` that some sample of ``ids`` lacks."""
        with self.lock:
            return [k for k in keys if any(k not in self.owners.get(sid, {}) for sid in ids)]

    def birth(self, sid: str) -> Birth:
        with self.lock:
            return self.births[str(sid)]

    def drop(self, ids: Iterable[str]) -> None:
        with self.lock:
            for sid in ids:
                for d in (self.owners, self.metas, self.metadata, self.tokens, self.births):
                    d.pop(str(sid), None)

    def __len__(self) -> int:
        with self.lock:
            return len(self.owners)
