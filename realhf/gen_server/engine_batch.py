"""The running batch of realhf's generation engine (``realhf_engine.py``): requests and their sample rows as the
engine thread sees them, the grouping of rows by sampling parameters and their sampling, and the slot KV cache that
rows join and leave."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, List, Optional

import torch

from realhf.gen_server.api import SampleOutput, sample_seed
from realhf.impl.model.nn.generation import RowStreams, sample_with_mask
from realhf.impl.model.nn.kv_cache import KVCache

CHUNK = RowStreams.CHUNK  # a seeded sample's random numbers are drawn this many at a time, as generate does


@dataclasses.dataclass(eq=False)
class Req:
    """One request as the engine thread sees it."""

    rid: str
    ids: List[int]
    sp: Any  # SamplingParams
    fut: asyncio.Future
    outputs: List[Optional[SampleOutput]] = dataclasses.field(default_factory=list)
    rows: List["Row"] = dataclasses.field(default_factory=list)  # its samples, once admitted
    n_done: int = 0
    state: str = "waiting"  # waiting | running | done


class Row:
    """One sample of a running request (one row of the running batch and its KV cache)."""

    __slots__ = ("req", "j", "ids", "lps", "vers", "stop", "max_new", "min_new", "gen", "chunk", "done")

    def __init__(self, req: Req, j: int):
        sp = req.sp
        self.req, self.j = req, j
        self.ids: List[int] = []
        self.lps: List[float] = []
        self.vers: List[int] = []
        self.stop = frozenset(sp.stop_token_ids)
        self.max_new = sp.max_new_tokens
        self.min_new = sp.min_new_tokens if self.stop else 0  # nothing to ban without stop tokens
        # a seeded sample's own random stream, as RowStreams draws it: CHUNK float64 numbers at a time
        self.gen: Optional[torch.Generator] = None
        self.chunk: Optional[List[float]] = None
        if sp.seed is not None and not sp.greedy:
            self.gen = torch.Generator().manual_seed(sample_seed(sp.seed, j) % (2**63))
            self.chunk = torch.rand(CHUNK, generator=self.gen, dtype=torch.float64).tolist()
        self.done = False

    def refill_stream(self):
        """After a token: a seeded sample whose next step starts a new chunk of its stream draws that chunk."""
        if self.gen is not None and len(self.ids) % CHUNK == 0:
            self.chunk = torch.rand(CHUNK, generator=self.gen, dtype=torch.float64).tolist()


def sampling_key(sp) -> tuple:
    """Rows whose keys are equal are sampled together by one ``sample_with_mask`` call."""
    if sp.greedy:
        return (True, 1.0, 0, 1.0, False)
    return (False, float(sp.temperature), int(sp.top_k), float(sp.top_p), sp.seed is not None)


class Group:
    __slots__ = ("key", "rows", "idx", "all", "min_new")

    def __init__(self, key, rows: List[Row], idx: List[int], n_total: int, device):
        self.key, self.rows = key, rows
        self.all = len(idx) == n_total
        self.idx = None if self.all else torch.tensor(idx, dtype=torch.long, device=device)
        self.min_new = any(r.min_new for r in rows)


class SlotCache(KVCache):
    """The running batch's KV cache: a ``KVCache`` (same decode interface: ``lens``, ``k``/``v`` lists of
    ``[B, h_kv, positions, d]`` buffers, ``decode_attention``, ``advance``) whose rows live in slots of
    preallocated storage, so that rows joining and leaving the batch copy only their own keys/values:
    ``add`` writes new rows into free slots after the running ones, ``remove`` moves the last surviving
    rows into the holes finished rows leave (the batch order changes; the caller reorders its rows alike).
    Storage grows (rows and positions, geometrically) only when a new row does not fit. Invariant: every
    position after a row's ``lens`` and every free slot are zero, so masked positions never hold stale data."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, max_rows: int,
                 max_positions: int):
        self._n_layers, self._h, self._d, self._dtype, self._device = n_layers, n_kv_heads, head_dim, dtype, device
        self._max_rows, self._max_positions = max_rows, max_positions
        self._sk: List[torch.Tensor] = []
        self._sv: List[torch.Tensor] = []
        self._rows_cap = 0
        self.max_len = 0  # positions of the storage (KVCache.advance checks against it)
        self.lens = torch.zeros(0, dtype=torch.long, device=device)
        self.decoding = True
        self._prefill_idx = None
        self._mask = None
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []

    def _views(self):
        B = self.lens.numel()
        self.k = [s[:B] for s in self._sk]
        self.v = [s[:B] for s in self._sv]
        self._mask = None

    def _used(self) -> int:
        return int(self.lens.max()) + 1 if self.lens.numel() else 0

    def _reserve(self, rows: int, positions: int):
        if rows <= self._rows_cap and positions <= self.max_len:
            return
        R = min(self._max_rows, max(rows, 2 * self._rows_cap, 8)) if rows > self._rows_cap else self._rows_cap
        R = max(R, rows)
        P = max(positions, min(self._max_positions, self.max_len + self.max_len // 2)) \
            if positions > self.max_len else self.max_len
        B, u = self.lens.numel(), self._used()
        sk, sv = [], []
        for i in range(self._n_layers):
            nk = torch.zeros((R, self._h, P, self._d), dtype=self._dtype, device=self._device)
            nv = torch.zeros_like(nk)
            if B:
                nk[:B, :, :u] = self._sk[i][:B, :, :u]
                nv[:B, :, :u] = self._sv[i][:B, :, :u]
            sk.append(nk)
            sv.append(nv)
        self._sk, self._sv, self._rows_cap, self.max_len = sk, sv, R, P
        self._views()

    def add(self, other, rows: torch.Tensor, positions: int):
        """Append rows ``rows`` of the decoding cache ``other`` (freshly prefilled) as new last rows; make
        room for ``positions`` positions."""
        B, m = self.lens.numel(), rows.numel()
        o_lens = other.lens[rows]
        self._reserve(B + m, positions)
        u = int(o_lens.max()) + 1
        for i in range(self._n_layers):
            self._sk[i][B:B + m, :, :u] = other.k[i][rows, :, :u]
            self._sv[i][B:B + m, :, :u] = other.v[i][rows, :, :u]
        self.lens = torch.cat([self.lens, o_lens.to(self.lens.device)])
        self._views()

    def remove(self, keep: List[int]) -> List[int]:
        """Keep the rows at positions ``keep`` (ascending): the last survivors move into the holes of the
        others. Returns the new order (old position of each row)."""
        B, n = self.lens.numel(), len(keep)
        kept = set(keep)
        holes = [p for p in range(n) if p not in kept]
        movers = [p for p in keep if p >= n]
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        u = self._used()
        dev = self._device
        if holes:
            ht = torch.tensor(holes, dtype=torch.long, device=dev)
            mt = torch.tensor(movers, dtype=torch.long, device=dev)
            for s in self._sk + self._sv:
                s[ht, :, :u] = s[mt, :, :u]
        if n < B:
            for s in self._sk + self._sv:
                s[n:B, :, :u].zero_()
        self.lens = self.lens[torch.tensor(order, dtype=torch.long, device=self.lens.device)]
        self._views()
        return order


def sample_groups(logits: torch.Tensor, groups: List[Group], generator: Optional[torch.Generator]):
    """logits [B, V] (fp32) of the rows in ``groups`` -> (tokens [B], log-probs [B]); rows without a seed draw from
    ``generator``."""
    if len(groups) == 1 and groups[0].all:
        return _sample_group(logits, groups[0], generator)
    tok = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    lp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for g in groups:
        t, l = _sample_group(logits.index_select(0, g.idx), g, generator)
        tok[g.idx] = t
        lp[g.idx] = l.float()
    return tok, lp


def _sample_group(logits, g: Group, generator):
    greedy, temperature, top_k, top_p, seeded = g.key
    rows = g.rows
    ban = None
    if g.min_new:
        banned = [k for k, r in enumerate(rows) if len(r.ids) < r.min_new]
        if banned:
            ban = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            for k in banned:
                ban[k, list(rows[k].stop)] = True
    u = None
    if seeded:
        u = torch.tensor([r.chunk[len(r.ids) % CHUNK] for r in rows], dtype=torch.float64)
    return sample_with_mask(logits, greedy, temperature, top_k, top_p, generator, ban, u)
