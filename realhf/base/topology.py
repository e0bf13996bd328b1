"""Process topology: a data x tensor x pipeline grid over (a subset of) torch.distributed ranks.

The three axes are named ``dp`` (data parallel), ``tp`` (tensor parallel) and ``pp`` (pipeline parallel)
everywhere: in axis keys, coordinates, sizes and ranks. A :class:`ParallelDims` value (the sizes) is a
*layout*; a :class:`ParallelGrid` is one rank's process groups of a layout laid on a *mesh* (a set of global ranks).
Ranks inside a grid are ordered pp-major, then dp, then tp (tp innermost), so the ranks of one
tensor-parallel group are consecutive. A grid may cover only part of the world: ``ranks`` lists the
global ranks it uses, in grid order.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Dict, List, Optional, Sequence

AXES = ("pp", "dp", "tp")  # grid order: pp outermost, tp innermost


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """A layout: the sizes of the three parallel axes, ``dp`` x ``tp`` x ``pp``.

    Users write and read it as an allocation string ``d<dp>m<tp>p<pp>`` (ReaL's notation: d = dp,
    m = tp, "model" parallel, p = pp), e.g. ``d2m1p1``: :meth:`parse` reads one and ``str()`` writes one.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for k in ("dp", "tp", "pp"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims.{k} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, s: str) -> "ParallelDims":
        """Parse ``d2m2p1`` style strings (letters in any order, each at most once; missing ones are 1)."""
        s = s.strip()
        if not re.fullmatch(r"([dmp]\d+)+", s):
            raise ValueError(
                f"Bad parallel layout {s!r}: expected letters d (data), m (tensor/model), p (pipeline) "
                "each followed by a positive integer, e.g. 'd2m2p1'."
            )
        parts = re.findall(r"([dmp])(\d+)", s)
        seen = [p[0] for p in parts]
        dup = {x for x in seen if seen.count(x) > 1}
        if dup:
            raise ValueError(f"Bad parallel layout {s!r}: {sorted(dup)} given more than once.")
        vals = {k: int(v) for k, v in parts}
        for k, v in vals.items():
            if v < 1:
                raise ValueError(f"Bad parallel layout {s!r}: size of '{k}' must be >= 1, got {v}.")
        return cls(dp=vals.get("d", 1), tp=vals.get("m", 1), pp=vals.get("p", 1))

    def __str__(self):
        return f"d{self.dp}m{self.tp}p{self.pp}"


@dataclasses.dataclass(frozen=True)
class Coord:
    """A grid rank's position on each axis."""

    pp: int
    dp: int
    tp: int


class ProcessTopology:
    """Pure bookkeeping of a (pp, dp, tp) grid of a layout: grid rank <-> coordinate. No communication."""

    def __init__(self, layout: ParallelDims):
        self.layout = layout
        self.shape = (layout.pp, layout.dp, layout.tp)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def get_rank(self, pp: int, dp: int, tp: int) -> int:
        n_pp, n_dp, n_tp = self.shape
        if not (0 <= pp < n_pp and 0 <= dp < n_dp and 0 <= tp < n_tp):
            raise IndexError(f"coordinate (pp={pp}, dp={dp}, tp={tp}) outside grid {self.layout}")
        return (pp * n_dp + dp) * n_tp + tp

    def get_coord(self, rank: int) -> Coord:
        _, n_dp, n_tp = self.shape
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside grid {self.layout} of {self.world_size} ranks")
        return Coord(pp=rank // (n_dp * n_tp), dp=(rank // n_tp) % n_dp, tp=rank % n_tp)

    def axis_groups(self, axis: str) -> List[List[int]]:
        """All groups of grid ranks that vary only along ``axis`` (e.g. ``"tp"``: every tensor-parallel group)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; allowed: {AXES}")
        sizes = dict(zip(AXES, self.shape))
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*[range(sizes[a]) for a in others]):
            kw = dict(zip(others, fixed))
            groups.append([self.get_rank(**{**kw, axis: i}) for i in range(sizes[axis])])
        return groups

    def filter_match(self, **kw) -> List[int]:
        """Grid ranks whose coordinate matches every given axis value, e.g. ``filter_match(pp=0, tp=0)``."""
        out = []
        for r in range(self.world_size):
            c = dataclasses.asdict(self.get_coord(r))
            if all(c[k] == v for k, v in kw.items()):
                out.append(r)
        return out


class ParallelGrid:
    """Communication groups of one (pp, dp, tp) grid of a layout laid over global ranks ``ranks`` (its mesh).

    Construction calls ``torch.distributed.new_group`` for every group of the grid, so *every* rank of
    the default process group must construct the same grids in the same order (a torch.distributed
    rule). Ranks outside the grid get ``is_member == False`` and no groups. ``backend``: the backend of
    every group (a ``RuntimeEnv``'s ``backend``, e.g. ``cpu:gloo,cuda:nccl`` on GPU); None inherits the
    default group's.
    """

    def __init__(self, layout: ParallelDims, ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelGrid needs torch.distributed to be initialised first")
        self.topo = ProcessTopology(layout)
        self.layout = layout
        world = dist.get_world_size()
        self.ranks: List[int] = list(range(layout.world_size)) if ranks is None else list(ranks)
        if len(self.ranks) != layout.world_size:
            raise ValueError(
                f"layout {layout} needs {layout.world_size} ranks, but {len(self.ranks)} were given: {self.ranks}"
            )
        if len(set(self.ranks)) != len(self.ranks) or any(not 0 <= r < world for r in self.ranks):
            raise ValueError(f"grid ranks {self.ranks} must be distinct global ranks in [0, {world})")
        self.global_rank = dist.get_rank()
        self.is_member = self.global_rank in self.ranks
        self.grid_rank = self.ranks.index(self.global_rank) if self.is_member else -1

        self._groups: Dict[str, object] = {}
        self._group_ranks: Dict[str, List[int]] = {}
        for axis in AXES:
            for grp in self.topo.axis_groups(axis):
                granks = [self.ranks[r] for r in grp]
                # new_group is collective over the whole world; every rank must call it.
                g = dist.new_group(granks, backend=backend) if len(granks) > 1 else None
                if self.global_rank in granks:
                    self._groups[axis] = g
                    self._group_ranks[axis] = granks
        all_g = dist.new_group(self.ranks, backend=backend) if len(self.ranks) > 1 else None
        if self.is_member:
            self._groups["all"] = all_g
            self._group_ranks["all"] = list(self.ranks)
        # First and last pipeline stage of each (dp, tp) position: they share tied embeddings.
        if layout.pp > 1:
            for grp in self.topo.axis_groups("pp"):
                granks = [self.ranks[grp[0]], self.ranks[grp[-1]]]
                g = dist.new_group(granks, backend=backend)
                if self.global_rank in granks:
                    self._groups["embedding"] = g
                    self._group_ranks["embedding"] = granks
        self.coord = self.topo.get_coord(self.grid_rank) if self.is_member else None

    # ranks and sizes
    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # groups (None when the group has a single member)
    @property
    def dp_group(self):
        return self._groups.get("dp")

    @property
    def tp_group(self):
        return self._groups.get("tp")

    @property
    def pp_group(self):
        return self._groups.get("pp")

    @property
    def embedding_group(self):
        """Group of the first and last stage (None when pp == 1 or this rank is a middle stage)."""
        return self._groups.get("embedding")

    @property
    def all_group(self):
        return self._groups.get("all")

    def group_ranks(self, axis: str) -> List[int]:
        """Global ranks of this rank's group along ``axis`` ('dp', 'tp', 'pp' or 'all')."""
        return list(self._group_ranks[axis])

    def global_rank_of(self, pp: int, dp: int, tp: int) -> int:
        return self.ranks[self.topo.get_rank(pp, dp, tp)]

    def stage_neighbor(self, offset: int) -> Optional[int]:
        """Global rank of the same (dp, tp) position ``offset`` stages away, or None at the ends."""
        p = self.pp_rank + offset
        if not 0 <= p < self.pp_size:
            return None
        return self.global_rank_of(p, self.dp_rank, self.tp_rank)

    def __repr__(self):
        where = f"coord={self.coord}" if self.is_member else "not a member"
        return f"ParallelGrid({self.layout}, ranks={self.ranks}, {where})"


def single_process_grid(env=None) -> "ParallelGrid":
    """A 1x1x1 grid for code that runs without torch.distributed: initialises a 1-rank process group with the
    backend of ``env`` (a ``realhf.base.runtime_env.RuntimeEnv``; default the CPU environment's) if none is."""
    import torch.distributed as dist

    from realhf.base.runtime_env import cpu_env

    env = env or cpu_env()
    if not dist.is_initialized():
        import datetime

        env.activate()
        # a store on a port the system picks as it binds (no free-port-then-bind race with other processes)
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
        dist.init_process_group(env.backend, store=store, rank=0, world_size=1)
    return ParallelGrid(ParallelDims(1, 1, 1), ranks=[dist.get_rank()], backend=env.backend)
