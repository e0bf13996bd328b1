"""Parameter reallocation: redistribute a model's parameters from one parallel layout to another.

A :class:`PlacedLayout` is a layout (a ``ParallelDims``) plus the global ranks of its grid (grid order: pp, dp, tp).
Parameter names are layout independent and every parameter has a full shape; a rank holds, for each
parameter of its pipeline stage, the tensor-parallel slice ``shard_bounds`` along ``tp_shard_dim``
(heads split by whole GQA groups, so slices may be uneven), all of it in one flat buffer.

:func:`make_plan` computes, from the model config and the two layouts alone (no communication, the
same result on every rank), which piece of which source buffer every destination rank needs:

* each piece of a destination slice is taken from one source rank that holds it — the destination
  rank itself when it holds the piece in the source layout (a local copy), otherwise the data-parallel
  replica with the fewest bytes to send so far (the load spreads over the replicas);
* a tied output head (``head.lm_head.weight``) is read from the embedding, its authoritative copy;
* the pieces between one (source, destination) pair travel as one message: a slice of the flat
  buffer itself when they form one contiguous range on both sides (e.g. a pipeline-only change),
  otherwise packed into one buffer and unpacked into views on arrival.

:func:`execute_plan` runs one rank's part over the default process group with a single batch of
point-to-point operations (gloo on CPU, NCCL on GPU). The copies are exact: after reallocation the
destination holds the source's parameters bit for bit.

Devices that share no communicator use the disk path instead (see ``realhf.system.trainer.model_worker``):
the source layout saves a HF checkpoint and the destination layout loads it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from realhf.api.core.model_api import ReaLModelConfig
from realhf.base.topology import ParallelDims, ProcessTopology
from realhf.impl.model.nn.real_model import shard_bounds, tied_source_name, tp_shard_dim

View = Tuple[int, Tuple[int, ...], Tuple[int, ...]]  # (storage offset, size, stride) into a flat buffer


@dataclasses.dataclass(frozen=True)
class PlacedLayout:
    """A layout laid on global ranks: ``ranks[g]`` is the global rank of grid rank ``g``."""

    layout: ParallelDims
    ranks: Tuple[int, ...]

    def __post_init__(self):
        if len(self.ranks) != self.layout.world_size:
            raise ValueError(f"layout {self.layout} needs {self.layout.world_size} ranks, got {list(self.ranks)}")

    @classmethod
    def of(cls, layout: ParallelDims, ranks: Sequence[int]) -> "PlacedLayout":
        return cls(layout, tuple(int(r) for r in ranks))

    def __str__(self):
        return f"{self.layout}@{list(self.ranks)}"


class _StageView:
    """The grid attributes ReaLModel reads, for one coordinate of a layout (no process groups)."""

    tp_group = None

    def __init__(self, layout: ParallelDims, pp_rank: int, tp_rank: int):
        self.tp_size, self.pp_size, self.pp_rank, self.tp_rank = layout.tp, layout.pp, pp_rank, tp_rank


_SPEC_CACHE: Dict[tuple, Dict[str, Tuple[int, torch.Size]]] = {}


def stage_param_spec(cfg: ReaLModelConfig, layout: ParallelDims, pp_rank: int,
                     tp_rank: int) -> Dict[str, Tuple[int, torch.Size]]:
    """``{name: (offset, local shape)}`` of the flat buffer of the rank at (``pp_rank``, ``tp_rank``) of
    ``layout`` — exactly what ``ReaLModel(cfg, grid).param_spec`` is on that rank (built on the meta device)."""
    from realhf.impl.model.nn.real_model import ReaLModel

    key = (repr(cfg), layout, pp_rank, tp_rank)
    if key not in _SPEC_CACHE:
        m = ReaLModel(cfg, grid=_StageView(layout, pp_rank, tp_rank), dtype=torch.float32, device="meta")
        _SPEC_CACHE[key] = dict(m.param_spec)
    return _SPEC_CACHE[key]


@dataclasses.dataclass
class Message:
    """Everything one source rank sends to one destination rank."""

    src: int
    dst: int
    src_views: List[View]
    dst_views: List[View]
    numel: int
    # (src offset, dst offset, numel) when all pieces form one contiguous range on both sides
    contiguous: Optional[Tuple[int, int, int]] = None


@dataclasses.dataclass
class ReallocPlan:
    src: PlacedLayout
    dst: PlacedLayout
    messages: List[Message]  # in a fixed order, the same on every rank

    @property
    def total_numel(self) -> int:
        return sum(m.numel for m in self.messages)

    @property
    def remote_numel(self) -> int:
        return sum(m.numel for m in self.messages if m.src != m.dst)

    def describe(self) -> str:
        n_local = sum(1 for m in self.messages if m.src == m.dst)
        return (f"realloc {self.src} -> {self.dst}: {len(self.messages)} messages ({n_local} local), "
                f"{self.total_numel} elements, {self.remote_numel} over the network")


def _view(off: int, shape: torch.Size, dim: Optional[int], start: int, n: int) -> Tuple[View, bool]:
    """(view, contiguous) of parameter slice ``narrow(dim, start, n)`` of a tensor at ``off`` in a flat buffer."""
    t = torch.empty(shape, device="meta")
    if dim is not None:
        t = t.narrow(dim, start, n)
    return (off + t.storage_offset(), tuple(t.shape), tuple(t.stride())), t.is_contiguous()


def check_compatible(cfg: ReaLModelConfig, src: PlacedLayout, dst: PlacedLayout):
    """Both layouts must be valid for the model (heads, layers, vocabulary divide)."""
    for what, lay in (("source", src), ("destination", dst)):
        try:
            cfg.check_layout(lay.layout.tp, lay.layout.pp)
        except ValueError as e:
            raise ValueError(f"cannot reallocate to/from {what} layout {lay}: {e}") from None


def make_plan(cfg: ReaLModelConfig, src: PlacedLayout, dst: PlacedLayout) -> ReallocPlan:
    """The messages that move every parameter of ``src`` onto ``dst`` (see the module docstring)."""
    check_compatible(cfg, src, dst)
    stopo, dtopo = ProcessTopology(src.layout), ProcessTopology(dst.layout)
    # which source stage holds each name, and its per-tensor-rank specs
    src_specs = {(p, t): stage_param_spec(cfg, src.layout, p, t)
                 for p in range(src.layout.pp) for t in range(src.layout.tp)}
    stage_of: Dict[str, int] = {}
    for (p, t), spec in src_specs.items():
        for n in spec:
            stage_of.setdefault(n, p)
    load: Dict[int, int] = {r: 0 for r in src.ranks}
    pieces: Dict[Tuple[int, int], List[Tuple[View, bool, View, bool, int]]] = {}
    for g in range(dtopo.world_size):
        c = dtopo.get_coord(g)
        gd = dst.ranks[g]
        for name, (doff, dshape) in stage_param_spec(cfg, dst.layout, c.pp, c.tp).items():
            sname = tied_source_name(cfg, name)
            if sname not in stage_of:
                raise KeyError(f"parameter {name!r} of layout {dst.layout} has no source in layout {src.layout}")
            sp = stage_of[sname]
            d = tp_shard_dim(name)
            dlo, dhi = shard_bounds(cfg, name, dst.layout.tp, c.tp) if d is not None else (0, 0)
            # (source tensor rank, [lo, hi) of the full tensor) pieces of this destination slice
            if d is None:
                regions = [(None, 0, 0)]
            else:
                regions = []
                for t in range(src.layout.tp):
                    slo, shi = shard_bounds(cfg, sname, src.layout.tp, t)
                    if max(slo, dlo) < min(shi, dhi):
                        regions.append((t, max(slo, dlo), min(shi, dhi)))
            for t, lo, hi in regions:
                ts = range(src.layout.tp) if t is None else [t]  # a replicated parameter: any tp rank
                cands = [(src.ranks[stopo.get_rank(sp, r, tt)], tt) for tt in ts for r in range(src.layout.dp)]
                mine = [x for x in cands if x[0] == gd]
                gs, tt = mine[0] if mine else min(cands, key=lambda x: (load[x[0]], cands.index(x)))
                soff, sshape = src_specs[(sp, tt)][sname]
                if d is None:
                    sv, sc = _view(soff, sshape, None, 0, 0)
                    dv, dc = _view(doff, dshape, None, 0, 0)
                else:
                    slo = shard_bounds(cfg, sname, src.layout.tp, tt)[0]
                    sv, sc = _view(soff, sshape, d, lo - slo, hi - lo)
                    dv, dc = _view(doff, dshape, d, lo - dlo, hi - lo)
                assert sv[1] == dv[1], (name, sv, dv)
                numel = math.prod(sv[1])
                if gs != gd:
                    load[gs] += numel
                pieces.setdefault((gs, gd), []).append((sv, sc, dv, dc, numel))
    messages = []
    for (gs, gd) in sorted(pieces):
        ps = pieces[(gs, gd)]
        msg = Message(gs, gd, [p[0] for p in ps], [p[2] for p in ps], sum(p[4] for p in ps))
        if all(p[1] and p[3] for p in ps):
            s0, d0 = ps[0][0][0], ps[0][2][0]
            so, do = s0, d0
            ok = True
            for sv, _, dv, _, n in ps:
                if sv[0] != so or dv[0] != do:
                    ok = False
                    break
                so, do = so + n, do + n
            if ok:
                msg.contiguous = (s0, d0, msg.numel)
        messages.append(msg)
    return ReallocPlan(src, dst, messages)


def _as_view(flat: torch.Tensor, v: View) -> torch.Tensor:
    return flat.as_strided(v[1], v[2], v[0])


def _pack(flat: torch.Tensor, views: List[View], numel: int) -> torch.Tensor:
    buf = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    off = 0
    for v in views:
        t = _as_view(flat, v)
        n = t.numel()
        buf[off : off + n].view(t.shape).copy_(t)
        off += n
    return buf


def _unpack(buf: torch.Tensor, flat: torch.Tensor, views: List[View]):
    off = 0
    for v in views:
        t = _as_view(flat, v)
        n = t.numel()
        t.copy_(buf[off : off + n].view(t.shape))
        off += n


def execute_plan(plan: ReallocPlan, rank: int, src_flat: Optional[torch.Tensor], dst_flat: Optional[torch.Tensor],
                 group=None) -> Dict[str, int]:
    """Run this rank's sends, receives and local copies of ``plan``. ``src_flat`` / ``dst_flat`` are this
    rank's flat buffers in the source / destination layout (None where it has no part there).
    Collective over the ranks of the plan: each of them must call it with the same plan."""
    import torch.distributed as dist

    if rank in plan.src.ranks and src_flat is None:
        raise ValueError(f"rank {rank} is in the source layout {plan.src} but has no source buffer")
    if rank in plan.dst.ranks and dst_flat is None:
        raise ValueError(f"rank {rank} is in the destination layout {plan.dst} but has no destination buffer")
    if src_flat is not None and dst_flat is not None and src_flat.dtype != dst_flat.dtype:
        raise ValueError(f"reallocation needs one dtype on both layouts, got {src_flat.dtype} and {dst_flat.dtype}")
    ops, unpack = [], []
    sent = received = local = 0
    for m in plan.messages:
        if m.src == rank and m.dst == rank:
            if m.contiguous is not None:
                s, d, n = m.contiguous
                dst_flat[d : d + n].copy_(src_flat[s : s + n])
            else:
                for sv, dv in zip(m.src_views, m.dst_views):
                    _as_view(dst_flat, dv).copy_(_as_view(src_flat, sv))
            local += m.numel
        elif m.src == rank:
            buf = (src_flat[m.contiguous[0] : m.contiguous[0] + m.numel] if m.contiguous is not None
                   else _pack(src_flat, m.src_views, m.numel))
            ops.append(dist.P2POp(dist.isend, buf, m.dst, group))
            sent += m.numel
        elif m.dst == rank:
            if m.contiguous is not None:
                buf = dst_flat[m.contiguous[1] : m.contiguous[1] + m.numel]
            else:
                buf = torch.empty(m.numel, dtype=dst_flat.dtype, device=dst_flat.device)
                unpack.append((buf, m.dst_views))
            ops.append(dist.P2POp(dist.irecv, buf, m.src, group))
            received += m.numel
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for buf, views in unpack:
        _unpack(buf, dst_flat, views)
    return {"sent": sent, "received": received, "local": local}
