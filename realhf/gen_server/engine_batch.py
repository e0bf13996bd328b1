"""The running batch of realhf's generation engine (``realhf_engine.py``): requests and their sample rows as the
engine thread sees them, the grouping of rows by sampling parameters and their sampling by the decode core's
``sample_step`` (``realhf.impl.model.nn.decode_core``; a request whose sampling raises fails alone: ``sample_groups``),
and the slot KV cache that rows join and leave."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, List, Optional

import torch

from realhf.gen_server.api import SampleOutput, sample_seed
from realhf.impl.model.nn.decode_core import SamplingKey, sample_step
from realhf.impl.model.nn.sampling import RowStreams
from realhf.impl.model.nn.kv_cache import KVCache, SharedPrefixCache

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


_GREEDY = SamplingKey(True, 1.0, 0, 1.0)


def sampling_key(sp) -> tuple:
    """``(SamplingKey, seeded)``: rows whose keys are equal are sampled together by one ``sample_step`` call (every
    greedy row alike, whatever its other parameters)."""
    if sp.greedy:
        return (_GREEDY, False)
    return (SamplingKey.of(sp), sp.seed is not None)


class Group:
    __slots__ = ("key", "rows", "idx", "all", "min_new")

    def __init__(self, key, rows: List[Row], idx: List[int], n_total: int, device):
        self.key, self.rows = key, rows
        self.all = len(idx) == n_total
        self.idx = None if self.all else torch.tensor(idx, dtype=torch.long, device=device)
        self.min_new = any(r.min_new for r in rows)


class _Slots:
    """Per-layer key and value storage, ``[rows, h_kv, positions, d]`` each, whose first ``n`` rows are in use: rows
    join at the end (``append``) and leave by ``compact``, which moves the last survivors into the holes the others
    leave, so rows joining and leaving copy only their own keys/values. Storage grows (rows and positions,
    geometrically, up to ``max_rows`` and ``max_positions``) only when a new row does not fit. Invariant: every
    position a row does not use and every free row are zero, so masked positions never hold stale data; except that
    a CUDA-graph step (``graph_decode.PaddedGraphDecoder``, over ``SlotCache`` only) writes position 0 of the free
    rows it pads the batch with, which ``append`` overwrites before the slot is used (a new row copies at least one
    position)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, max_rows: int, max_positions: int):
        self._n_layers, self._h, self._d, self._dtype, self._device = n_layers, n_kv_heads, head_dim, dtype, device
        self._max_rows, self._max_positions = max_rows, max_positions
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []
        self.rows_cap = 0
        self.positions = 0  # of the storage
        self.n = 0

    def reserve(self, rows: int, positions: int, used: int):
        """Room for ``rows`` rows of ``positions`` positions; ``used``: the positions in use (copied when growing)."""
        if rows <= self.rows_cap and positions <= self.positions:
            return
        R = min(self._max_rows, max(rows, 2 * self.rows_cap, 8)) if rows > self.rows_cap else self.rows_cap
        R = max(R, rows)
        P = max(positions, min(self._max_positions, self.positions + self.positions // 2)) \
            if positions > self.positions else self.positions
        sk, sv = [], []
        for i in range(self._n_layers):
            nk = torch.zeros((R, self._h, P, self._d), dtype=self._dtype, device=self._device)
            nv = torch.zeros_like(nk)
            if self.n:
                nk[:self.n, :, :used] = self.k[i][:self.n, :, :used]
                nv[:self.n, :, :used] = self.v[i][:self.n, :, :used]
            sk.append(nk)
            sv.append(nv)
        self.k, self.v, self.rows_cap, self.positions = sk, sv, R, P

    def append(self, src_k: List[torch.Tensor], src_v: List[torch.Tensor], rows: torch.Tensor, used: int):
        """Copy rows ``rows`` (their first ``used`` positions) of the per-layer tensors ``src_k``/``src_v`` in as new
        last rows (``reserve`` made room)."""
        B, m = self.n, rows.numel()
        for i in range(self._n_layers):
            self.k[i][B:B + m, :, :used] = src_k[i][rows, :, :used]
            self.v[i][B:B + m, :, :used] = src_v[i][rows, :, :used]
        self.n = B + m

    def compact(self, keep: List[int], used: int) -> List[int]:
        """Keep the rows at positions ``keep`` (ascending; ``used``: the positions in use): the last survivors move into
        the holes of the others. Returns the new order (old position of each row)."""
        B, n = self.n, len(keep)
        kept = set(keep)
        holes = [p for p in range(n) if p not in kept]
        movers = [p for p in keep if p >= n]
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        if holes:
            ht = torch.tensor(holes, dtype=torch.long, device=self._device)
            mt = torch.tensor(movers, dtype=torch.long, device=self._device)
            for s in self.k + self.v:
                s[ht, :, :used] = s[mt, :, :used]
        if n < B:
            for s in self.k + self.v:
                s[n:B, :, :used].zero_()
        self.n = n
        return order


class SlotCache(KVCache):
    """The running batch's KV cache: a ``KVCache`` (same decode interface: ``lens``, ``k``/``v`` lists of
    ``[B, h_kv, positions, d]`` buffers, ``decode_attention``, ``advance``) whose rows live in the slots of a
    ``_Slots`` storage: ``add`` writes new rows into free slots after the running ones, ``remove`` moves the last
    surviving rows into the holes finished rows leave (the batch order changes; the caller reorders its rows
    alike)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, max_rows: int,
                 max_positions: int):
        self._slots = _Slots(n_layers, n_kv_heads, head_dim, dtype, device, max_rows, max_positions)
        self.max_len = 0  # positions of the storage (KVCache.advance checks against it)
        self.lens = torch.zeros(0, dtype=torch.long, device=device)
        self.decoding = True
        self._prefill_idx = None
        self._mask = None
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []

    def _views(self):
        B = self.lens.numel()
        self.k = [s[:B] for s in self._slots.k]
        self.v = [s[:B] for s in self._slots.v]
        self.max_len = self._slots.positions
        self._mask = None

    def _used(self) -> int:
        return int(self.lens.max()) + 1 if self.lens.numel() else 0

    def storage(self):
        """The per-layer key and value storage, ``[capacity, h_kv, positions, d]`` each, the running rows first."""
        return self._slots.k, self._slots.v

    def add(self, other, rows: torch.Tensor, positions: int):
        """Append rows ``rows`` of the decoding cache ``other`` (freshly prefilled) as new last rows; make
        room for ``positions`` positions."""
        o_lens = other.lens[rows]
        self._slots.reserve(self.lens.numel() + rows.numel(), positions, self._used())
        self._slots.append(other.k, other.v, rows, int(o_lens.max()) + 1)
        self.lens = torch.cat([self.lens, o_lens.to(self.lens.device)])
        self._views()

    def remove(self, keep: List[int]) -> List[int]:
        """Keep the rows at positions ``keep`` (ascending): the last survivors move into the holes of the
        others. Returns the new order (old position of each row)."""
        order = self._slots.compact(keep, self._used())
        self.lens = self.lens[torch.tensor(order, dtype=torch.long, device=self.lens.device)]
        self._views()
        return order


class SharedSlotCache(SharedPrefixCache):
    """The running batch's KV cache when the samples of a request share its prompt: a ``SharedPrefixCache`` (same
    decode: each prompt's keys/values read once per step for all its samples) whose rows' own positions and whose
    prompts (prefixes) each live in a ``_Slots`` storage, so rows joining and leaving copy only their own data. A
    prompt's keys/values stay while any of its samples runs. ``add`` and ``remove`` as ``SlotCache``'s."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, max_rows: int,
                 max_positions: int):
        self._own = _Slots(n_layers, n_kv_heads, head_dim, dtype, device, max_rows, max_positions)
        self._pre = _Slots(n_layers, n_kv_heads, head_dim, dtype, device, max_rows, max_positions)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self.own, self.lens, self.row_p, self.row_j, self.plens = empty, empty, empty, empty, empty
        self.slots = 1
        self.max_len = 0
        self.decoding = True
        self._prefill_idx = None
        self._mask = None
        self.k, self.v, self.pk, self.pv = [], [], [], []

    def _views(self):
        B, P = self.own.numel(), self.plens.numel()
        Lp = int(self.plens.max()) if P else 0
        self.k = [s[:B] for s in self._own.k]
        self.v = [s[:B] for s in self._own.v]
        self.pk = [s[:P, :, :Lp] for s in self._pre.k]
        self.pv = [s[:P, :, :Lp] for s in self._pre.v]
        self.slots = int(self.row_j.max()) + 1 if B else 1
        self.max_len = self._own.positions
        self._mask = None

    def _own_used(self) -> int:
        return int(self.own.max()) + 1 if self.own.numel() else 0

    def add(self, other, rows: torch.Tensor, positions: int):
        """Append one row per entry of ``rows`` (a row of the decoding cache ``other``, freshly prefilled with one row
        per distinct prompt): the rows of one prompt share its keys/values, copied once. ``positions``: the most
        positions a new row may reach, its prompt included."""
        dev = self.own.device
        uniq, inv = torch.unique(rows, return_inverse=True)
        o_lens = other.lens[uniq].to(dev)
        P0 = self.plens.numel()
        self._pre.reserve(P0 + uniq.numel(), int(o_lens.max()), int(self.plens.max()) if P0 else 0)
        self._pre.append(other.k, other.v, uniq, int(o_lens.max()))
        taken: dict = {}  # rows of each new prompt so far: a row's index among its prompt's rows
        row_j = []
        for p in inv.tolist():
            row_j.append(taken.get(p, 0))
            taken[p] = row_j[-1] + 1
        m = rows.numel()
        self._own.reserve(self.own.numel() + m, positions - int(o_lens.min()), self._own_used())
        self._own.n += m  # new rows start with no positions of their own (free slots are zero)
        self.plens = torch.cat([self.plens, o_lens])
        self.row_p = torch.cat([self.row_p, P0 + inv.to(dev)])
        self.row_j = torch.cat([self.row_j, torch.tensor(row_j, dtype=torch.long, device=dev)])
        self.own = torch.cat([self.own, torch.zeros(m, dtype=torch.long, device=dev)])
        self.lens = torch.cat([self.lens, o_lens[inv.to(dev)]])
        self._views()

    def remove(self, keep: List[int]) -> List[int]:
        """Keep the rows at positions ``keep`` (ascending), as ``SlotCache.remove``; a prompt no row uses any more
        leaves the prefix storage. Returns the new order (old position of each row)."""
        order = self._own.compact(keep, self._own_used())
        ot = torch.tensor(order, dtype=torch.long, device=self.own.device)
        self.own, self.lens, self.row_p, self.row_j = self.own[ot], self.lens[ot], self.row_p[ot], self.row_j[ot]
        used = sorted(set(self.row_p.tolist()))
        P = self.plens.numel()
        if len(used) < P:
            porder = self._pre.compact(used, int(self.plens.max()))
            pt = torch.tensor(porder, dtype=torch.long, device=self.own.device)
            remap = torch.full((P,), -1, dtype=torch.long, device=self.own.device)
            remap[pt] = torch.arange(len(porder), device=self.own.device)
            self.row_p = remap[self.row_p]
            self.plens = self.plens[pt]
        self._views()
        return order


def sample_groups(logits: torch.Tensor, groups: List[Group], generator: Optional[torch.Generator]):
    """logits [B, V] (fp32) of the rows in ``groups`` -> (tokens [B], log-probs [B], failures); rows without a seed
    draw from ``generator``. One sampling call per group; a group whose call raises is sampled again request by
    request, so one request that cannot be sampled fails alone: ``failures`` lists ``(request, exception)`` for
    those, whose rows' tokens are undefined (empty on the normal path, which pays nothing for this)."""
    whole = len(groups) == 1 and groups[0].all
    if whole:
        try:
            return (*_sample_group(logits, groups[0], generator), [])
        except Exception:  # noqa: BLE001 - isolated below, request by request
            pass
    tok = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    lp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if whole:
        return tok, lp, _sample_apart(logits, groups[0], generator, tok, lp)
    failures: List[tuple] = []
    for g in groups:
        try:
            _sample_into(logits, g, generator, tok, lp)
        except Exception:  # noqa: BLE001 - isolated below, request by request
            failures += _sample_apart(logits, g, generator, tok, lp)
    return tok, lp, failures


def _sample_into(logits, g: Group, generator, tok, lp):
    if g.all:
        t, l = _sample_group(logits, g, generator)
        tok.copy_(t)
        lp.copy_(l.float())
    else:
        t, l = _sample_group(logits.index_select(0, g.idx), g, generator)
        tok[g.idx] = t
        lp[g.idx] = l.float()


def _sample_apart(logits, g: Group, generator, tok, lp) -> List[tuple]:
    """Sample the rows of group ``g`` (whose call raised) one request at a time; return ``(request, exception)`` of
    the requests whose sampling still raises."""
    pos = range(len(g.rows)) if g.all else g.idx.tolist()
    by_req: dict = {}  # id of a request -> (request, its rows, their positions in the batch)
    for row, i in zip(g.rows, pos):
        _, rows, idx = by_req.setdefault(id(row.req), (row.req, [], []))
        rows.append(row)
        idx.append(i)
    failures = []
    for req, rows, idx in by_req.values():
        try:
            _sample_into(logits, Group(g.key, rows, idx, logits.shape[0], logits.device), generator, tok, lp)
        except Exception as e:  # noqa: BLE001 - this request's own failure: reported to it alone
            failures.append((req, e))
    return failures


def _sample_group(logits, g: Group, generator):
    key, seeded = g.key
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
    return sample_step(logits, key, generator, ban=ban, row_u=u)
