"""Time of communication in an execution plan, from a device's link rates (:class:`realhf.plan.hardware.Hardware`):
collectives and point-to-point sends, the gradient all-reduce over data parallelism, parameter reallocation between
two layouts, data moved between model function calls, and weight publication to generation servers. Pure
arithmetic, no torch (except :func:`realloc_exact`, which asks the reallocation planner). Every function returns
seconds.

* all-reduce (ring): ``2 (n - 1) / n * bytes / bw + 2 (n - 1) * latency``; a send: ``latency + bytes / bw``.
* Ranks are placed in grid order (pp, dp, tp; tp innermost) from a mesh's first rank, ``devices_per_node``
  to a node: a group is inside one node when the ranks it spans are.
* Reallocation (:func:`realloc_traffic`): the planner's rule (``realhf.impl.model.parallelism.realloc``) at the
  grain of (block ranges, embedding, head) x tensor slices: each destination rank takes a piece from itself when it
  holds it in the source layout, otherwise from the least-loaded data-parallel replica of the source; a tied head is
  read from the embedding. Tensor slices are taken as even (uneven key/value head splits differ by a head's share).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from realhf.api.core.model_api import ReaLModelConfig, stage_layer_range
from realhf.plan.hardware import Hardware


def allreduce(hw: Hardware, nbytes: float, n: int, intra: bool = True) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = hw.link(intra)
    if intra and hw.allreduce_bw > 0:  # measured: the reduction's own work on the way (gloo on CPU)
        bw = hw.allreduce_bw
    return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat


def send(hw: Hardware, nbytes: float, intra: bool = True, lat: Optional[float] = None) -> float:
    """One message of ``nbytes`` over the link: its latency (``lat``, default the link's) and its bytes."""
    if nbytes <= 0:
        return 0.0
    bw, link_lat = hw.link(intra)
    return (link_lat if lat is None else lat) + nbytes / bw


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A layout on devices: ``dp`` x ``tp`` x ``pp`` ranks from global rank ``first`` on, in grid order."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    first: int = 0

    def __post_init__(self):
        for k in ("dp", "tp", "pp"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"Mesh.{k} must be a positive integer, got {getattr(self, k)!r}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank of grid coordinate (``pp``, ``dp``, ``tp``)."""
        return self.first + (pp * self.dp + dp) * self.tp + tp

    def intra(self, span: int, hw: Hardware) -> bool:
        """Whether a group of ``span`` consecutive ranks from this mesh's first lies inside one node."""
        return self.first // hw.devices_per_node == (self.first + span - 1) // hw.devices_per_node


def grad_allreduce(hw: Hardware, params_per_rank: float, grad_bytes: int, mesh: Mesh) -> float:
    """The data-parallel all-reduce of a rank's gradients."""
    return allreduce(hw, params_per_rank * grad_bytes, mesh.dp, mesh.intra(mesh.dp * mesh.tp, hw))


def _units(cfg: ReaLModelConfig, pp: int, stage: int):
    """(unit, first layer, end layer, elements) a stage holds: its blocks, the embedding (first stage), the head
    (last stage; a tied head inside one stage is the embedding itself)."""
    from realhf.plan.memory import Shard, params

    H, V = cfg.hidden_dim, cfg.vocab_size
    whole = params(Shard(cfg))
    embed = V * H + (cfg.n_positions or 0) * H
    head = 0 if cfg.is_critic else V * H
    n_head = H if cfg.is_critic else (0 if cfg.tied_embedding else head)
    per_layer = (whole - embed - n_head) / cfg.n_layers
    s, e = stage_layer_range(cfg.n_layers, pp, stage)
    out = [("blocks", s, e, per_layer)]
    if stage == 0:
        out.append(("embed", 0, 1, embed))
    if stage == pp - 1 and not (cfg.tied_embedding and not cfg.is_critic and pp == 1):
        out.append(("head", 0, 1, head if not cfg.is_critic else H))
    return out


def realloc_traffic(cfg: ReaLModelConfig, src: Mesh, dst: Mesh) -> Dict[int, Tuple[float, float, int]]:
    """Per global rank, (elements sent, elements received, remote messages) to reallocate ``cfg``'s parameters from
    ``src`` to ``dst``; local copies are not counted."""
    import heapq

    load: Dict[int, float] = {}
    recv: Dict[int, float] = {}
    pairs = set()
    msgs: Dict[int, int] = {}
    src_units = {p: {u[0]: u for u in _units(cfg, src.pp, p)} for p in range(src.pp)}
    # the source ranks of stage ps and tensor slice ts, one per data-parallel replica: each rank is in one such group,
    # so a group's least-loaded rank (the lowest replica among equals) is the top of its own heap
    groups = {}
    for ps in range(src.pp):
        for ts in range(src.tp):
            ranks = [src.rank(ps, r, ts) for r in range(src.dp)]
            groups[(ps, ts)] = ([(0.0, r, g) for r, g in enumerate(ranks)], frozenset(ranks))
    # the pieces a destination (stage, tensor rank) needs, the same for each of its data-parallel replicas
    pieces = {}
    for pd in range(dst.pp):
        units = _units(cfg, dst.pp, pd)
        for td in range(dst.tp):
            lo_d, hi_d = td / dst.tp, (td + 1) / dst.tp
            out = []
            for name, s, e, n in units:
                sname = "embed" if (name == "head" and cfg.tied_embedding and not cfg.is_critic) else name
                for ps in range(src.pp):
                    have = src_units[ps].get(sname)  # how much of this unit stage ps of the source holds
                    if have is None:
                        continue
                    layers = max(0, min(e, have[2]) - max(s, have[1])) if name == "blocks" else 1
                    if layers == 0:
                        continue
                    for ts in range(src.tp):
                        f = max(0.0, min(hi_d, (ts + 1) / src.tp) - max(lo_d, ts / src.tp))
                        if f > 0:
                            out.append((groups[(ps, ts)], n * layers * f))
            pieces[(pd, td)] = out
    for pd in range(dst.pp):
        for dd in range(dst.dp):
            for td in range(dst.tp):
                gd = dst.rank(pd, dd, td)
                for (heap, members), numel in pieces[(pd, td)]:
                    if gd in members:
                        continue
                    ld, r, gs = heap[0]
                    heapq.heapreplace(heap, (ld + numel, r, gs))
                    load[gs] = ld + numel
                    recv[gd] = recv.get(gd, 0.0) + numel
                    if (gs, gd) not in pairs:
                        pairs.add((gs, gd))
                        msgs[gs] = msgs.get(gs, 0) + 1
                        msgs[gd] = msgs.get(gd, 0) + 1
    return {r: (load.get(r, 0.0), recv.get(r, 0.0), msgs.get(r, 0)) for r in set(load) | set(recv)}


def realloc(hw: Hardware, cfg: ReaLModelConfig, src: Mesh, dst: Mesh, dtype_bytes: int,
            traffic: Optional[Dict[int, Tuple[float, float, int]]] = None) -> float:
    """Parameter reallocation from ``src`` to ``dst``: the busiest rank's bytes sent or received (all messages in one
    batch, sending and receiving at once) plus a latency per message; 0 when every piece is local."""
    t = realloc_traffic(cfg, src, dst) if traffic is None else traffic
    if not t:
        return 0.0
    lo = min(src.first, dst.first)
    hi = max(src.first + src.world, dst.first + dst.world) - 1
    intra = lo // hw.devices_per_node == hi // hw.devices_per_node
    if intra and hw.realloc_bw > 0:  # measured on this machine (realhf.plan.probes.realloc_rates)
        return hw.realloc_fixed_s + max((max(s, r) + hw.realloc_both_ways * min(s, r)) * dtype_bytes / hw.realloc_bw
                                        for s, r, _ in t.values())
    bw, lat = hw.link(intra)
    return max(max(s, r) * dtype_bytes / bw + m * lat for s, r, m in t.values())


def realloc_exact(cfg: ReaLModelConfig, src: Mesh, dst: Mesh) -> Dict[int, Tuple[float, float, int]]:
    """:func:`realloc_traffic` from the reallocation planner's own messages (torch; the model built on the meta
    device), for checking the closed form and for plans worth the cost."""
    from realhf.base.topology import ParallelDims
    from realhf.impl.model.parallelism.realloc import PlacedLayout, make_plan

    def lay(m: Mesh):
        return PlacedLayout.of(ParallelDims(m.dp, m.tp, m.pp), range(m.first, m.first + m.world))

    plan = make_plan(cfg, lay(src), lay(dst))
    out: Dict[int, list] = {}
    for msg in plan.messages:
        if msg.src == msg.dst:
            continue
        out.setdefault(msg.src, [0.0, 0.0, 0])
        out.setdefault(msg.dst, [0.0, 0.0, 0])
        out[msg.src][0] += msg.numel
        out[msg.dst][1] += msg.numel
        out[msg.src][2] += 1
        out[msg.dst][2] += 1
    return {r: tuple(v) for r, v in out.items()}


def data_transfer(hw: Hardware, tokens: float, bytes_per_token: float, src: Mesh, dst: Mesh,
                  messages: int = 0) -> float:
    """Moving ``tokens`` tokens of an MFC's outputs (``bytes_per_token``: e.g. 8 for token ids, 4 per fp32 value)
    from ``src``'s data-parallel ranks to ``dst``'s: each destination rank receives its share, the sources sending
    theirs at once, in ``messages`` messages over the whole batch (one per sample and key), each destination rank its
    share of them at the cost of a batched message; nothing moves when the two meshes are the same ranks with the same
    data split."""
    if src.first == dst.first and src.dp == dst.dp and src.tp == dst.tp and src.pp == dst.pp:
        return 0.0
    per_rank = tokens * bytes_per_token / min(src.dp, dst.dp)
    lo, hi = min(src.first, dst.first), max(src.first + src.world, dst.first + dst.world) - 1
    intra = lo // hw.devices_per_node == hi // hw.devices_per_node
    each = hw.p2p_msg_s or hw.link(intra)[1]
    return send(hw, per_rank, intra) + max(0, -(-messages // dst.dp) - 1) * each


def hf_tensor_count(cfg: ReaLModelConfig) -> int:
    """The named tensors of ``cfg``'s HF checkpoint (what a publication sends one by one): per block its projections,
    their biases, its norms; the embedding, the final norm and an untied head."""
    per = 4 + 2 + (3 if cfg.mlp_type == "gated" else 2)  # q k v o, two norms, the MLP's projections
    per += 3 * cfg.use_attention_bias + cfg.use_attn_proj_bias + 2 * cfg.qk_layernorm
    per += (3 if cfg.mlp_type == "gated" else 2) * cfg.use_mlp_bias
    per += 2 * (cfg.layer_norm_type == "layer")  # a LayerNorm's bias beside each weight
    if cfg.family == "gpt2":  # one fused q/k/v projection (and bias)
        per -= 2 + 2 * cfg.use_attention_bias
    tail = 1 + (cfg.n_positions is not None) + 1 + (cfg.layer_norm_type == "layer") + (not cfg.tied_embedding)
    return cfg.n_layers * per + tail


def publish_weights(hw: Hardware, params: float, dtype_bytes: int, servers: int, method: str = "disk",
                    disk_bw: Optional[float] = None, tensors: int = 1) -> float:
    """Publishing a model's weights to ``servers`` generation servers: ``disk`` (one checkpoint written, then read by
    every server at once from the shared file system: the reads share ``disk_bw``) or ``broadcast`` (a tree broadcast
    from the trainer over the network: ``log2(servers + 1)`` rounds of the whole model, each of its ``tensors`` a
    broadcast of its own that pays the link's latency)."""
    nbytes = params * dtype_bytes
    if method == "disk":
        bw = disk_bw if disk_bw is not None else hw.disk_bw
        return nbytes / bw + servers * nbytes / bw
    if method == "broadcast":
        import math

        rounds = math.ceil(math.log2(servers + 1))
        lat = hw.broadcast_lat or hw.link(False)[1]
        return rounds * (send(hw, nbytes, intra=False) + (max(1, tensors) - 1) * lat)
    raise ValueError(f"publish_weights: method={method!r}; allowed: 'disk', 'broadcast'")
