"""The process topology speaks one vocabulary: the axes are ``pp``, ``dp`` and ``tp`` in axis keys, coordinates and
ranks, a ``ParallelDims`` is a layout (``d<dp>m<tp>p<pp>`` as an allocation string), and a grid maps them onto
global ranks."""
import dataclasses

import pytest

from realhf.base.topology import AXES, Coord, ParallelDims, ProcessTopology
from realhf.testing import run_distributed


def test_coordinates_and_axis_groups_are_named_pp_dp_tp():
    layout = ParallelDims(dp=2, tp=2, pp=2)
    topo = ProcessTopology(layout)
    assert AXES == ("pp", "dp", "tp") and topo.layout is layout
    assert topo.get_coord(5) == Coord(pp=1, dp=0, tp=1)
    assert topo.get_rank(pp=1, dp=0, tp=1) == 5
    assert all(topo.get_rank(**dataclasses.asdict(topo.get_coord(g))) == g for g in range(layout.world_size))
    assert topo.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp innermost: consecutive ranks
    assert topo.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pp=1, tp=0) == [4, 6]
    with pytest.raises(ValueError, match=r"unknown axis 'tensor'; allowed: \('pp', 'dp', 'tp'\)"):
        topo.axis_groups("tensor")
    with pytest.raises(IndexError, match=r"coordinate \(pp=2, dp=0, tp=0\) outside grid d2m2p2"):
        topo.get_rank(2, 0, 0)


def _grid_worker():
    import torch.distributed as dist

    from realhf.base.topology import ParallelGrid

    grid = ParallelGrid(ParallelDims(dp=1, tp=2, pp=2), ranks=[3, 2, 1, 0])  # laid on the world in reverse
    return (dist.get_rank(), grid.coord, grid.layout, grid.group_ranks("tp"), grid.group_ranks("pp"),
            grid.group_ranks("dp"), grid.global_rank_of(pp=1, dp=0, tp=0), grid.stage_neighbor(1))


def test_grid_groups_are_keyed_by_axis_on_global_ranks():
    for rank, coord, layout, tp, pp, dp, last_stage_head, next_stage in run_distributed(_grid_worker, 4, timeout=120):
        g = 3 - rank  # grid rank
        assert coord == Coord(pp=g // 2, dp=0, tp=g % 2) and layout == ParallelDims(1, 2, 2), (rank, coord)
        assert tp == [3 - 2 * (g // 2), 2 - 2 * (g // 2)], (rank, tp)
        assert pp == [3 - g % 2, 1 - g % 2] and dp == [rank], (rank, pp, dp)
        assert last_stage_head == 1 and next_stage == (rank - 2 if g < 2 else None), rank
