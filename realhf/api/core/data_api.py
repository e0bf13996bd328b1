"""Packed batches of several keys: :class:`SequenceSample`.

A ``SequenceSample`` holds ``bs`` samples. Every key (``packed_input_ids``, ``rewards``, ...) is one
tensor packed along dim 0 (the concatenation over samples, trailing dims allowed) with its own
per-sample lengths: ``seqlens[key][i]`` is the list of lengths of the sequences that sample ``i``
holds for ``key`` (several when e.g. ``group_size`` answers are generated per prompt).
``data is None`` means metadata only, which is all the master keeps.

Splitting (:meth:`SequenceSample.split`, :meth:`SequenceSample.split_mbs`) is always *contiguous*:
parts are runs of consecutive samples, so gathering the parts in order restores the original
batch. The partition itself is available as lists of indices (``split_partition``,
``mb_partition``) for results that are not ``SequenceSample`` (see :func:`merge_by_partition`).

The wire format (``to_wire``/``from_wire``, ``to_bytes``/``from_bytes``) never pickles: a JSON-able
header (plain str/int/float/bool/None/list/dict) plus raw tensors; dtypes travel as strings from an
allow-list.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Hashable, Sequence

import torch

from realhf.base import logging
from realhf.base.plain_json import check_plain_json
# the dtypes that may travel: one allow-list for every wire format of a run
from realhf.base.wire import DTYPE_NAMES as _DTYPE_NAMES
from realhf.base.wire import DTYPES as _DTYPES
from realhf.api.core.partition import _greedy_parts, balanced_partition, merge_by_partition  # noqa: F401

logger = logging.getLogger(__name__)

# Keys preferred as the "main" key (the one whose tokens measure a sample's cost), in order.
MAIN_KEY_PREFERENCE = ("packed_input_ids", "packed_seq", "packed_prompts", "input_ids")
WIRE_FORMAT = "realhf.SequenceSample"
WIRE_VERSION = 1
_BYTES_MAGIC = b"RHFSS\x00\x01\x00"


def dtype_to_str(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be serialised; allowed: {sorted(_DTYPES)}")
    return _DTYPE_NAMES[dtype]


def str_to_dtype(name: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in header; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]


# ----------------------------------------------------------------------------------------------
# SequenceSample
# ----------------------------------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(eq=False, repr=False)
class SequenceSample:
    """A packed batch of ``bs`` samples holding several keys (see the module docstring)."""

    keys: set[str]
    ids: list[Hashable]
    seqlens: dict[str, list[list[int]]]
    trailing_shapes: dict[str, tuple]
    dtypes: dict[str, torch.dtype]
    data: dict[str, torch.Tensor | None] | None = None
    metadata: dict[str, list] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        self.keys = set(self.keys)
        self.ids = list(self.ids)
        bs = len(self.ids)
        if bs == 0:
            raise ValueError("a SequenceSample needs at least one sample (ids is empty)")
        if not self.keys:
            raise ValueError("a SequenceSample needs at least one key")
        for k in self.keys:
            if not isinstance(k, str):
                raise ValueError(f"keys must be str, got {k!r}")
        if len(set(self.ids)) != bs:
            dups = sorted({str(i) for i in self.ids if self.ids.count(i) > 1})
            raise ValueError(f"ids must be unique; duplicated: {dups}")
        for name, d in (("seqlens", self.seqlens), ("trailing_shapes", self.trailing_shapes), ("dtypes", self.dtypes)):
            if set(d) != self.keys:
                raise ValueError(
                    f"{name} keys {sorted(d)} do not match the sample keys {sorted(self.keys)}"
                )
        if self.data is not None and set(self.data) != self.keys:
            raise ValueError(f"data keys {sorted(self.data)} do not match the sample keys {sorted(self.keys)}")
        seqlens = {}
        for k in sorted(self.keys):
            sl = self.seqlens[k]
            if not isinstance(sl, (list, tuple)) or len(sl) != bs:
                raise ValueError(
                    f"seqlens[{k!r}] must be a list with one entry per sample ({bs}), got "
                    f"{len(sl) if isinstance(sl, (list, tuple)) else type(sl).__name__}"
                )
            rows = []
            for i, lens in enumerate(sl):
                if not isinstance(lens, (list, tuple)):
                    raise ValueError(
                        f"seqlens[{k!r}][{i}] must be a list of ints (lengths of sample {i}'s sequences), "
                        f"got {lens!r}; use SequenceSample.from_default for one sequence per sample"
                    )
                row = []
                for x in lens:
                    if not _is_int(x) and not (hasattr(x, "__index__") and not isinstance(x, bool)):
                        raise ValueError(f"seqlens[{k!r}][{i}] holds a non-integer length {x!r}")
                    if int(x) < 0:
                        raise ValueError(f"seqlens[{k!r}][{i}] holds a negative length {x}")
                    row.append(int(x))
                rows.append(row)
            seqlens[k] = rows
            dt = self.dtypes[k]
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"dtypes[{k!r}] must be a torch.dtype, got {dt!r}")
            ts = self.trailing_shapes[k]
            if ts is None or not all(_is_int(s) and s >= 0 for s in ts):
                raise ValueError(f"trailing_shapes[{k!r}] must be a tuple of non-negative ints, got {ts!r}")
            self.trailing_shapes[k] = tuple(ts)
        self.seqlens = seqlens
        if self.data is not None:
            for k in sorted(self.keys):
                t = self.data[k]
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"data[{k!r}] must be a torch.Tensor or None, got {type(t).__name__}")
                n_tok = sum(map(sum, self.seqlens[k]))
                expected = (n_tok, *self.trailing_shapes[k])
                if tuple(t.shape) != expected:
                    raise ValueError(
                        f"data[{k!r}] has shape {tuple(t.shape)} but seqlens/trailing_shapes say {expected} "
                        f"(lengths sum to {n_tok})"
                    )
                if t.dtype != self.dtypes[k]:
                    raise ValueError(f"data[{k!r}] has dtype {t.dtype} but dtypes says {self.dtypes[k]}")
        self.metadata = dict(self.metadata or {})
        for mk, mv in self.metadata.items():
            if not isinstance(mv, (list, tuple)) or len(mv) != bs:
                raise ValueError(
                    f"metadata[{mk!r}] must be a list with one entry per sample ({bs}), got "
                    f"{len(mv) if isinstance(mv, (list, tuple)) else type(mv).__name__}"
                )
            self.metadata[mk] = list(mv)

    @classmethod
    def from_default(
        cls,
        ids: Sequence[Hashable],
        seqlens: Sequence[int],
        data: dict[str, torch.Tensor],
        metadata: dict[str, list] | None = None,
    ) -> "SequenceSample":
        """One sequence per sample; every key shares ``seqlens`` except keys whose tensor has one
        row per sample (size ``bs`` along dim 0, e.g. ``rewards``), which get length 1 each."""
        ids, seqlens = list(ids), [int(x) for x in seqlens]
        bs, n_tok = len(ids), sum(int(x) for x in seqlens)
        if len(seqlens) != bs:
            raise ValueError(f"{bs} ids but {len(seqlens)} seqlens")
        key_lens, shapes, dtypes = {}, {}, {}
        for k, t in data.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise ValueError(f"data[{k!r}] must be a tensor with at least one dim, got {t!r}")
            if t.shape[0] == n_tok:
                key_lens[k] = [[x] for x in seqlens]
            elif t.shape[0] == bs:
                key_lens[k] = [[1] for _ in range(bs)]
            else:
                raise ValueError(
                    f"data[{k!r}] has {t.shape[0]} rows: expected {n_tok} (sum of seqlens) or {bs} (one per sample)"
                )
            shapes[k], dtypes[k] = tuple(t.shape[1:]), t.dtype
        return cls(set(data), ids, key_lens, shapes, dtypes, dict(data), metadata or {})

    # ------------------------------------------------------------------ basic info
    @property
    def bs(self) -> int:
        return len(self.ids)

    def __len__(self) -> int:
        return self.bs

    def __repr__(self) -> str:
        kinds = {k: (self.dtypes[k], self.trailing_shapes[k], self.total_tokens(k)) for k in sorted(self.keys)}
        return (
            f"SequenceSample(bs={self.bs}, ids={self.ids[:4]}{'...' if self.bs > 4 else ''}, "
            f"keys(dtype, trailing, tokens)={kinds}, has_data={self.data is not None}, "
            f"metadata={sorted(self.metadata)})"
        )

    def main_key(self) -> str:
        """The key whose token count measures a sample's cost: the first of
        ``MAIN_KEY_PREFERENCE`` present, else the key with the most tokens (ties: by name)."""
        for k in MAIN_KEY_PREFERENCE:
            if k in self.keys:
                return k
        return max(sorted(self.keys), key=lambda k: self.total_tokens(k))

    def _key(self, key: str | None) -> str:
        key = self.main_key() if key is None else key
        if key not in self.keys:
            raise KeyError(f"key {key!r} not in sample keys {sorted(self.keys)}")
        return key

    def total_tokens(self, key: str | None = None) -> int:
        return sum(map(sum, self.seqlens[self._key(key)]))

    def sample_tokens(self, key: str | None = None) -> list[int]:
        """Tokens of each sample for ``key`` (default: the main key)."""
        return [sum(x) for x in self.seqlens[self._key(key)]]

    def flat_seqlens(self, key: str | None = None) -> list[int]:
        """Lengths of all sequences of ``key``, flattened over samples."""
        return [x for lens in self.seqlens[self._key(key)] for x in lens]

    def cu_seqlens(self, key: str | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 cumulative lengths ``[0, l0, l0+l1, ...]`` of the flattened sequences of ``key``."""
        lens = torch.tensor(self.flat_seqlens(key), dtype=torch.int32, device=device)
        return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))

    def _offsets(self, key: str) -> list[int]:
        off = [0]
        for lens in self.seqlens[key]:
            off.append(off[-1] + sum(lens))
        return off

    # ------------------------------------------------------------------ copies and views
    def meta(self) -> "SequenceSample":
        """A copy without tensors (what the master keeps)."""
        return SequenceSample(
            set(self.keys),
            list(self.ids),
            {k: [list(x) for x in v] for k, v in self.seqlens.items()},
            dict(self.trailing_shapes),
            dict(self.dtypes),
            None,
            {k: list(v) for k, v in self.metadata.items()},
        )

    def take(self, indices: Sequence[int]) -> "SequenceSample":
        """A new sample holding samples ``indices`` (in that order, no repeats)."""
        indices = [int(i) for i in indices]
        for i in indices:
            if not 0 <= i < self.bs:
                raise IndexError(f"sample index {i} out of range for bs={self.bs}")
        data = None
        if self.data is not None:
            data = {}
            for k in self.keys:
                t = self.data[k]
                if t is None:
                    data[k] = None
                    continue
                off = self._offsets(k)
                # Merge consecutive indices into runs to keep the number of slices small.
                pieces, s = [], 0
                while s < len(indices):
                    e = s
                    while e + 1 < len(indices) and indices[e + 1] == indices[e] + 1:
                        e += 1
                    pieces.append(t[off[indices[s]] : off[indices[e] + 1]])
                    s = e + 1
                data[k] = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, 0)
        return SequenceSample(
            set(self.keys),
            [self.ids[i] for i in indices],
            {k: [list(v[i]) for i in indices] for k, v in self.seqlens.items()},
            dict(self.trailing_shapes),
            dict(self.dtypes),
            data,
            {k: [v[i] for i in indices] for k, v in self.metadata.items()},
        )

    def reorder(self, indices: Sequence[int]) -> "SequenceSample":
        """Permute the samples: result[j] = self[indices[j]]; ``indices`` must be a permutation."""
        if sorted(int(i) for i in indices) != list(range(self.bs)):
            raise ValueError(f"reorder needs a permutation of range({self.bs}), got {list(indices)}")
        return self.take(indices)

    def unpack(self) -> list["SequenceSample"]:
        """One SequenceSample per sample."""
        return [self.take([i]) for i in range(self.bs)]

    def __getitem__(self, i: int | slice) -> "SequenceSample":
        if isinstance(i, slice):
            return self.take(range(self.bs)[i])
        if not _is_int(i):
            raise TypeError(f"index a SequenceSample with an int or a slice, got {type(i).__name__}")
        return self.take([i % self.bs if -self.bs <= i < 0 else i])

    def select(self, keys: Sequence[str]) -> "SequenceSample":
        """A sample with only ``keys`` (tensors shared, not copied)."""
        keys = set(keys)
        missing = keys - self.keys
        if missing:
            raise KeyError(f"keys {sorted(missing)} not in sample keys {sorted(self.keys)}")
        return SequenceSample(
            keys,
            list(self.ids),
            {k: [list(x) for x in self.seqlens[k]] for k in keys},
            {k: self.trailing_shapes[k] for k in keys},
            {k: self.dtypes[k] for k in keys},
            None if self.data is None else {k: self.data[k] for k in keys},
            {k: list(v) for k, v in self.metadata.items()},
        )

    def remap_keys(self, mapping: dict[str, str]) -> "SequenceSample":
        """A sample with keys renamed by ``{old: new}`` (keys not in ``mapping`` keep their name)."""
        missing = set(mapping) - self.keys
        if missing:
            raise KeyError(f"cannot rename keys {sorted(missing)}: not in sample keys {sorted(self.keys)}")
        new_names = [mapping.get(k, k) for k in self.keys]
        if len(set(new_names)) != len(new_names):
            raise ValueError(f"renaming {mapping} makes two keys share a name (keys: {sorted(self.keys)})")

        def ren(d):
            return {mapping.get(k, k): v for k, v in d.items()}

        return SequenceSample(
            set(new_names),
            list(self.ids),
            ren(self.seqlens),
            ren(self.trailing_shapes),
            ren(self.dtypes),
            None if self.data is None else ren(self.data),
            {k: list(v) for k, v in self.metadata.items()},
        )

    def update_(self, other: "SequenceSample") -> None:
        """Amend ``other``'s keys (and metadata) in place, for the same set of ids.

        ``other`` may list the ids in another order; it is reordered to match. Keys present in both
        are overwritten by ``other``. Both must hold data, or both be metadata only.
        """
        if set(other.ids) != set(self.ids) or other.bs != self.bs:
            raise ValueError(
                f"update_ needs the same ids: self has {self.bs} ids, other {other.bs}; "
                f"only in self: {sorted(map(str, set(self.ids) - set(other.ids)))[:5]}, "
                f"only in other: {sorted(map(str, set(other.ids) - set(self.ids)))[:5]}"
            )
        if (self.data is None) != (other.data is None):
            raise ValueError("update_ cannot mix a metadata-only sample with one holding data")
        if other.ids != self.ids:
            pos = {x: i for i, x in enumerate(other.ids)}
            other = other.reorder([pos[x] for x in self.ids])
        for k in other.keys:
            self.seqlens[k] = [list(x) for x in other.seqlens[k]]
            self.trailing_shapes[k] = other.trailing_shapes[k]
            self.dtypes[k] = other.dtypes[k]
            if self.data is not None:
                self.data[k] = other.data[k]
        self.keys |= other.keys
        for mk, mv in other.metadata.items():
            self.metadata[mk] = list(mv)

    @classmethod
    def gather(cls, samples: Sequence["SequenceSample"], keys: Sequence[str] | None = None) -> "SequenceSample":
        """Concatenate samples (in the given order). ``keys`` defaults to the first one's keys;
        every sample must hold them, with the same dtypes/trailing shapes and metadata fields."""
        if not samples:
            raise ValueError("gather needs at least one SequenceSample")
        keys = set(samples[0].keys if keys is None else keys)
        first = samples[0]
        has_data = first.data is not None
        for j, s in enumerate(samples):
            if not keys <= s.keys:
                raise ValueError(f"sample {j} lacks keys {sorted(keys - s.keys)} for gather")
            if (s.data is not None) != has_data:
                raise ValueError("gather cannot mix metadata-only samples with samples holding data")
            if set(s.metadata) != set(first.metadata):
                raise ValueError(
                    f"sample {j} has metadata fields {sorted(s.metadata)}, sample 0 has {sorted(first.metadata)}"
                )
            for k in keys:
                if s.dtypes[k] != first.dtypes[k] or s.trailing_shapes[k] != first.trailing_shapes[k]:
                    raise ValueError(
                        f"key {k!r}: sample {j} has dtype {s.dtypes[k]} / trailing shape {s.trailing_shapes[k]}, "
                        f"sample 0 has {first.dtypes[k]} / {first.trailing_shapes[k]}"
                    )
        data = None
        if has_data:
            data = {}
            for k in keys:
                ts = [s.data[k] for s in samples]
                if all(t is None for t in ts):
                    data[k] = None
                elif any(t is None for t in ts):
                    raise ValueError(f"key {k!r} has a tensor in some samples and None in others")
                else:
                    data[k] = torch.cat(ts, 0)
        return cls(
            keys,
            [i for s in samples for i in s.ids],
            {k: [list(x) for s in samples for x in s.seqlens[k]] for k in keys},
            {k: first.trailing_shapes[k] for k in keys},
            {k: first.dtypes[k] for k in keys},
            data,
            {mk: [v for s in samples for v in s.metadata[mk]] for mk in first.metadata},
        )

    # ------------------------------------------------------------------ splitting
    def split_partition(self, n: int, key: str | None = None) -> list[list[int]]:
        """Indices of the ``n`` contiguous parts :meth:`split` produces (balanced by tokens of
        ``key``, default the main key; the largest part's tokens are minimal among contiguous
        partitions)."""
        if not _is_int(n) or n < 1:
            raise ValueError(f"split needs a positive number of parts, got {n!r}")
        if self.bs < n:
            raise ValueError(f"cannot split a batch of {self.bs} samples into {n} non-empty parts (bs < n)")
        return balanced_partition(self.sample_tokens(key), n)

    def split(self, n: int, key: str | None = None) -> list["SequenceSample"]:
        """Split into ``n`` non-empty contiguous parts (e.g. one per dp rank) balanced by tokens.

        Parts keep the original order, so ``gather(split(n))`` is the original batch."""
        return [self.take(p) for p in self.split_partition(n, key)]

    def mb_partition(self, max_tokens_per_mb: int, min_n_mbs: int = 1, key: str | None = None) -> list[list[int]]:
        """Indices of the contiguous micro-batches :meth:`split_mbs` produces.

        The count is the smallest that keeps every micro-batch within ``max_tokens_per_mb``, raised
        to ``min(min_n_mbs, bs)``; with that count, the largest micro-batch is made as small as
        possible. A single sample above the budget forms a micro-batch of its own (never cut)."""
        if not _is_int(max_tokens_per_mb) or max_tokens_per_mb < 1:
            raise ValueError(f"max_tokens_per_mb must be a positive int, got {max_tokens_per_mb!r}")
        if not _is_int(min_n_mbs) or min_n_mbs < 1:
            raise ValueError(f"min_n_mbs must be a positive int, got {min_n_mbs!r}")
        w = self.sample_tokens(key)
        n = max(len(_greedy_parts(w, max_tokens_per_mb)), min(min_n_mbs, self.bs))
        too_long = [i for i, x in enumerate(w) if x > max_tokens_per_mb]
        if too_long:
            logger.warning(
                f"{len(too_long)} sample(s) exceed max_tokens_per_mb={max_tokens_per_mb} "
                f"(longest {max(w)} tokens); each goes alone in its own micro-batch"
            )
        return balanced_partition(w, n, cap=max_tokens_per_mb)

    def split_mbs(self, max_tokens_per_mb: int, min_n_mbs: int = 1, key: str | None = None) -> list["SequenceSample"]:
        """Cut into contiguous micro-batches under a token budget (see :meth:`mb_partition`).
        ``gather`` of the micro-batches (or of per-micro-batch outputs) restores the order."""
        return [self.take(p) for p in self.mb_partition(max_tokens_per_mb, min_n_mbs, key)]

    # ------------------------------------------------------------------ wire format
    def to_wire(self) -> tuple[dict, list[torch.Tensor]]:
        """``(header, tensors)``: the header holds only JSON-able plain data; ``tensors`` are the
        non-None tensors in ``header["tensor_keys"]`` order (``tensor_keys`` is None without data)."""
        for i in self.ids:
            if not (_is_int(i) or isinstance(i, str)):
                raise ValueError(f"ids must be str or int to go on the wire, got {i!r} ({type(i).__name__})")
        keys = sorted(self.keys)
        tensor_keys = None if self.data is None else [k for k in keys if self.data[k] is not None]
        header = {
            "format": WIRE_FORMAT,
            "version": WIRE_VERSION,
            "keys": keys,
            "ids": list(self.ids),
            "seqlens": {k: [list(x) for x in self.seqlens[k]] for k in keys},
            "trailing_shapes": {k: list(self.trailing_shapes[k]) for k in keys},
            "dtypes": {k: dtype_to_str(self.dtypes[k]) for k in keys},
            "metadata": {k: list(v) for k, v in self.metadata.items()},
            "tensor_keys": tensor_keys,
        }
        try:
            check_plain_json(header["metadata"], "metadata")
        except ValueError as e:
            raise ValueError(f"metadata cannot go on the wire: {e}") from e
        tensors = [] if tensor_keys is None else [self.data[k] for k in tensor_keys]
        return header, tensors

    @classmethod
    def from_wire(cls, header: dict, tensors: Sequence[torch.Tensor]) -> "SequenceSample":
        if not isinstance(header, dict):
            raise ValueError(f"wire header must be a dict, got {type(header).__name__}")
        check_plain_json(header, "header")
        if header.get("format") != WIRE_FORMAT or header.get("version") != WIRE_VERSION:
            raise ValueError(
                f"not a {WIRE_FORMAT} v{WIRE_VERSION} header: format={header.get('format')!r}, "
                f"version={header.get('version')!r}"
            )
        for f in ("keys", "ids", "seqlens", "trailing_shapes", "dtypes", "metadata"):
            if f not in header:
                raise ValueError(f"wire header lacks field {f!r}")
        keys = header["keys"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("header 'keys' must be a list of str")
        for i in header["ids"]:
            if not (_is_int(i) or isinstance(i, str)):
                raise ValueError(f"header ids must be str or int, got {i!r}")
        if not isinstance(header["dtypes"], dict):
            raise ValueError("header field 'dtypes' must be a dict")
        dtypes = {k: str_to_dtype(v) for k, v in header["dtypes"].items()}
        tensor_keys = header.get("tensor_keys")
        data = None
        if tensor_keys is None:
            if len(tensors) != 0:
                raise ValueError(f"header says metadata only but {len(tensors)} tensors came with it")
        else:
            if not isinstance(tensor_keys, list) or not set(tensor_keys) <= set(keys):
                raise ValueError(f"header 'tensor_keys' {tensor_keys!r} must be a list of the sample keys")
            if len(tensors) != len(tensor_keys):
                raise ValueError(f"header lists {len(tensor_keys)} tensors but {len(tensors)} came")
            data = {k: None for k in keys}
            for k, t in zip(tensor_keys, tensors):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"tensor for key {k!r} is a {type(t).__name__}")
                data[k] = t
        for f in ("seqlens", "trailing_shapes", "dtypes", "metadata"):
            if not isinstance(header[f], dict):
                raise ValueError(f"header field {f!r} must be a dict")
        if not all(isinstance(v, list) for v in header["trailing_shapes"].values()):
            raise ValueError("header 'trailing_shapes' values must be lists of ints")
        return cls(
            set(keys),
            header["ids"],
            header["seqlens"],
            {k: tuple(v) for k, v in header["trailing_shapes"].items()},
            dtypes,
            data,
            header["metadata"],
        )

    def to_bytes(self) -> bytes:
        """One blob: magic, u64 header length, UTF-8 JSON header, then each tensor's raw bytes."""
        header, tensors = self.to_wire()
        raws = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
        header["tensor_nbytes"] = [len(r) for r in raws]
        hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
        return b"".join([_BYTES_MAGIC, struct.pack("<Q", len(hb)), hb, *raws])

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> "SequenceSample":
        blob = memoryview(blob)
        m = len(_BYTES_MAGIC)
        if len(blob) < m + 8 or bytes(blob[:m]) != _BYTES_MAGIC:
            raise ValueError("not a SequenceSample blob (bad magic)")
        (hlen,) = struct.unpack("<Q", blob[m : m + 8])
        pos = m + 8 + hlen
        if pos > len(blob):
            raise ValueError(f"blob truncated: header needs {hlen} bytes")
        try:
            header = json.loads(bytes(blob[m + 8 : pos]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"SequenceSample blob has a corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise ValueError("SequenceSample blob header is not a JSON object")
        nbytes = header.pop("tensor_nbytes", [])
        tensor_keys = header.get("tensor_keys") or []
        if not isinstance(nbytes, list) or len(nbytes) != len(tensor_keys) or not all(_is_int(x) and x >= 0 for x in nbytes):
            raise ValueError("blob header 'tensor_nbytes' must list one byte count per tensor")
        if pos + sum(nbytes) != len(blob):
            raise ValueError(f"blob has {len(blob) - pos} tensor bytes, header says {sum(nbytes)}")
        tensors = []
        for k, nb in zip(tensor_keys, nbytes):
            try:
                dtype = str_to_dtype(header["dtypes"][k])
                n_tok = sum(int(x) for lens in header["seqlens"][k] for x in lens)
                shape = (n_tok, *(int(x) for x in header["trailing_shapes"][k]))
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"SequenceSample blob header is malformed for tensor {k!r}: {e!r}") from e
            if nb == 0:
                t = torch.empty(0, dtype=torch.uint8)
            else:
                t = torch.frombuffer(bytearray(blob[pos : pos + nb]), dtype=torch.uint8)
            try:
                tensors.append(t.view(dtype).reshape(shape))
            except RuntimeError as e:
                raise ValueError(f"tensor {k!r}: {nb} bytes do not make a {dtype} tensor of shape {shape}") from e
            pos += nb
        return cls.from_wire(header, tensors)
