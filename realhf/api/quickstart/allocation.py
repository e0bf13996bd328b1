"""The allocation-mode grammar: which devices and which parallel layout each MFC uses.

Forms (whitespace around separators is ignored)::

    d4m2p1                                   "global": one layout for every MFC
    actor_gen:d4m1p1,actor_train:d2m2p1,*:d4m1p1
                                             "per_mfc": one layout per MFC, ``*`` is the default
    sglang.d16m4p1+d8m2p4                    "decoupled": generation servers (backend ``sglang``,
    vllm.d2m1p1+actor_train:d2m1p1,*:d1m1p1      ``vllm`` or ``gen`` = realhf's own engine) on a
                                             disjoint device set, everything else on the rest
    manual                                   layouts are given elsewhere in the experiment config
    heuristic                                choose a layout for the device count (see
                                             :func:`heuristic_layout`)
    search                                   the execution-plan search chooses each MFC's devices,
                                             layout and micro-batches on a model of the step's time
                                             (``realhf.plan.search``); the launcher turns it into a
                                             ``manual`` allocation before anything starts

In a layout the letters are d (data parallel), m (tensor/model parallel) and p (pipeline), in any
order, each at most once; a missing letter means 1.

Device counts (checked when ``n_devices`` is given):

* global: the layout's world size must equal ``n_devices``.
* per_mfc: every MFC's layout may use *at most* ``n_devices`` devices (an MFC with a smaller layout
  runs on the first devices of the world); the largest layout defines :meth:`AllocationMode.n_devices`.
  Using fewer devices than available in every layout is allowed but logged as a warning.
* decoupled: generation devices + devices of the rest must equal ``n_devices``; the generation
  layout must have ``p1`` (inference servers are not pipelined).

An MFC is a *generation* MFC (served by the decoupled generation devices) when its name is ``gen``
or ends with ``_gen`` (e.g. ``actor_gen``); see :func:`is_generation_mfc`.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Dict, List, Optional, Sequence

from realhf.base import logging
from realhf.base.topology import ParallelDims

logger = logging.getLogger(__name__)

KINDS = ("global", "per_mfc", "decoupled", "manual", "heuristic", "search")
_NO_LAYOUTS = ("manual", "heuristic", "search")  # kinds that give no layouts by themselves
GEN_BACKENDS = ("sglang", "vllm", "gen")
DEFAULT_KEY = "*"


def is_generation_mfc(name: str) -> bool:
    """True for MFCs that decoupled generation devices serve (``gen`` or ``*_gen``)."""
    return name == "gen" or name.endswith("_gen")


@dataclasses.dataclass
class AllocationMode:
    """A parsed allocation mode (see the module docstring)."""

    kind: str
    default: Optional[ParallelDims] = None
    per_mfc: Dict[str, ParallelDims] = dataclasses.field(default_factory=dict)
    gen_backend: Optional[str] = None
    gen: Optional[ParallelDims] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"AllocationMode.kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def is_decoupled(self) -> bool:
        return self.kind == "decoupled"

    def layout_of(self, mfc_name: str) -> ParallelDims:
        """The layout of ``mfc_name``: the generation layout for generation MFCs of a decoupled
        mode, else its own per-MFC entry, else the default."""
        if self.kind in _NO_LAYOUTS:
            raise ValueError(
                f"allocation mode {self.kind!r} has no layouts by itself: "
                + {"manual": "they are given elsewhere in the experiment config",
                   "heuristic": "call resolve_heuristic(n_devices, ...) first",
                   "search": "the launcher's plan search turns it into a manual allocation first"}[self.kind]
            )
        if self.kind == "decoupled" and is_generation_mfc(mfc_name):
            assert self.gen is not None
            return self.gen
        if mfc_name in self.per_mfc:
            return self.per_mfc[mfc_name]
        if self.default is not None:
            return self.default
        raise ValueError(
            f"allocation mode has no layout for MFC {mfc_name!r}: it names only {sorted(self.per_mfc)}; "
            f"add '{mfc_name}:<layout>' or a default '*:<layout>'"
        )

    def _rest_devices(self) -> int:
        sizes = [p.world_size for p in self.per_mfc.values()]
        if self.default is not None:
            sizes.append(self.default.world_size)
        return max(sizes)

    def n_devices(self) -> int:
        """Total devices this mode uses (for per-MFC specs, the largest layout)."""
        if self.kind in _NO_LAYOUTS:
            raise ValueError(f"allocation mode {self.kind!r} does not determine a device count by itself")
        n = self._rest_devices()
        if self.kind == "decoupled":
            assert self.gen is not None
            n += self.gen.world_size
        return n

    def rest_n_devices(self) -> int:
        """Devices of everything but the decoupled generation servers (all devices otherwise)."""
        if self.kind in _NO_LAYOUTS:
            raise ValueError(f"allocation mode {self.kind!r} does not determine a device count by itself")
        return self._rest_devices()

    def resolve_heuristic(self, n_devices: int, n_layers: Optional[int] = None,
                          n_heads: Optional[int] = None) -> "AllocationMode":
        """For ``heuristic``: the equivalent global mode for ``n_devices``; other kinds: ``self``."""
        if self.kind != "heuristic":
            return self
        return AllocationMode(kind="global", default=heuristic_layout(n_devices, n_layers, n_heads))

    def __str__(self) -> str:
        if self.kind in _NO_LAYOUTS:
            return self.kind
        rest = _format_rest(self.default, self.per_mfc)
        if self.kind == "decoupled":
            return f"{self.gen_backend}.{self.gen}+{rest}"
        return rest


def _format_rest(default: Optional[ParallelDims], per_mfc: Dict[str, ParallelDims]) -> str:
    if not per_mfc:
        return str(default)
    parts = [f"{k}:{v}" for k, v in per_mfc.items()]
    if default is not None:
        parts.append(f"{DEFAULT_KEY}:{default}")
    return ",".join(parts)


class AllocationError(ValueError):
    """A bad allocation-mode string; the message says which part is wrong and why."""


def _layout(part: str, whole: str, what: str) -> ParallelDims:
    try:
        return ParallelDims.parse(part)
    except ValueError as e:
        raise AllocationError(f"allocation mode {whole!r}: {what} {part!r} is not valid: {e}") from None


def _parse_rest(s: str, whole: str, what: str):
    """Parse a global layout or a per-MFC spec. Returns (default, per_mfc)."""
    if not s:
        raise AllocationError(f"allocation mode {whole!r}: the {what} part is empty")
    if ":" not in s and "," not in s:
        return _layout(s, whole, "the layout" if what == "layout" else f"the {what} layout"), {}
    default: Optional[ParallelDims] = None
    per_mfc: Dict[str, ParallelDims] = {}
    for item in s.split(","):
        item = item.strip()
        if not item:
            raise AllocationError(f"allocation mode {whole!r}: empty entry in the {what} list (stray ',')")
        name, sep, text = item.partition(":")
        name, text = name.strip(), text.strip()
        if not sep:
            raise AllocationError(
                f"allocation mode {whole!r}: entry {item!r} has no ':'; a per-MFC list needs "
                f"'<mfc_name>:<layout>' entries (use '*:<layout>' for the default)"
            )
        if not name:
            raise AllocationError(f"allocation mode {whole!r}: entry {item!r} has no MFC name before ':'")
        if not text:
            raise AllocationError(f"allocation mode {whole!r}: entry {item!r} has no layout after ':'")
        layout = _layout(text, whole, f"the layout of {name!r}")
        if name == DEFAULT_KEY:
            if default is not None:
                raise AllocationError(f"allocation mode {whole!r}: the default '*' is given more than once")
            default = layout
        else:
            if name in per_mfc:
                raise AllocationError(f"allocation mode {whole!r}: MFC {name!r} is given more than once")
            per_mfc[name] = layout
    return default, per_mfc


def parse_allocation_mode(s: str, mfc_names: Optional[Sequence[str]] = None,
                          n_devices: Optional[int] = None) -> AllocationMode:
    """Parse and validate an allocation-mode string (grammar and checks in the module docstring).

    ``mfc_names``: when given, per-MFC names must be among them, and every MFC must get a layout.
    ``n_devices``: when given, device counts are checked against it.
    """
    if not isinstance(s, str):
        raise AllocationError(f"allocation mode must be a string, got {s!r}")
    whole = s
    s = s.strip()
    if not s:
        raise AllocationError(
            "allocation mode is empty; expected e.g. 'd2m1p1', 'actor_gen:d2m1p1,*:d1m2p1', "
            "'vllm.d2m1p1+d2m1p1', 'manual', 'heuristic' or 'search'"
        )
    if n_devices is not None and (not isinstance(n_devices, int) or n_devices < 1):
        raise AllocationError(f"n_devices must be a positive integer, got {n_devices!r}")
    if s in _NO_LAYOUTS:
        return AllocationMode(kind=s)

    if "+" in s:
        gen_s, plus, rest_s = s.partition("+")
        if "+" in rest_s:
            raise AllocationError(f"allocation mode {whole!r}: more than one '+'; expected '<backend>.<layout>+<rest>'")
        backend, dot, gen_layout = gen_s.strip().partition(".")
        if not dot:
            raise AllocationError(
                f"allocation mode {whole!r}: the generation part {gen_s.strip()!r} needs a backend prefix, "
                f"one of {list(GEN_BACKENDS)}, e.g. 'vllm.{gen_s.strip()}'"
            )
        if backend not in GEN_BACKENDS:
            close = difflib.get_close_matches(backend, GEN_BACKENDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AllocationError(
                f"allocation mode {whole!r}: unknown generation backend {backend!r}{hint}; "
                f"allowed: {list(GEN_BACKENDS)}"
            )
        gen = _layout(gen_layout.strip(), whole, "the generation layout")
        if gen.pp != 1:
            raise AllocationError(
                f"allocation mode {whole!r}: the generation layout {gen_layout.strip()!r} has p{gen.pp}; "
                "generation servers do not support pipeline parallelism, use p1 (raise d or m instead)"
            )
        default, per_mfc = _parse_rest(rest_s.strip(), whole, "training/inference (after '+')")
        for name in per_mfc:
            if is_generation_mfc(name):
                raise AllocationError(
                    f"allocation mode {whole!r}: MFC {name!r} runs on the {backend} generation devices "
                    "(before '+'); remove it from the part after '+'"
                )
        mode = AllocationMode(kind="decoupled", default=default, per_mfc=per_mfc, gen_backend=backend, gen=gen)
    else:
        m = re.match(r"^([A-Za-z_]\w*)\.", s)
        if m:
            backend = m.group(1)
            raise AllocationError(
                f"allocation mode {whole!r}: a '{backend}.' generation part must be followed by "
                f"'+<layout>' for the other MFCs, e.g. '{s}+d1m1p1'"
            )
        default, per_mfc = _parse_rest(s, whole, "layout")
        mode = AllocationMode(kind="per_mfc" if per_mfc or ":" in s else "global", default=default, per_mfc=per_mfc)

    if mfc_names is not None:
        _check_mfc_names(mode, list(mfc_names), whole)
    if n_devices is not None:
        _check_devices(mode, n_devices, whole)
    return mode


def _check_mfc_names(mode: AllocationMode, mfc_names: List[str], whole: str) -> None:
    known = set(mfc_names)
    for name in mode.per_mfc:
        if name not in known:
            close = difflib.get_close_matches(name, mfc_names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise AllocationError(
                f"allocation mode {whole!r}: unknown MFC {name!r}; this experiment's MFCs are "
                f"{sorted(known)}.{hint}"
            )
    if mode.default is None:
        missing = [n for n in mfc_names if n not in mode.per_mfc and not (mode.is_decoupled and is_generation_mfc(n))]
        if missing:
            raise AllocationError(
                f"allocation mode {whole!r}: no layout for MFC(s) {missing}; add '<name>:<layout>' entries "
                "or a default '*:<layout>'"
            )


def _check_devices(mode: AllocationMode, n_devices: int, whole: str) -> None:
    if mode.kind == "global":
        n = mode.default.world_size
        if n != n_devices:
            raise AllocationError(
                f"allocation mode {whole!r}: layout {mode.default} uses {n} devices but the experiment has "
                f"{n_devices} (n_nodes * n_devices_per_node); the product d*m*p must equal {n_devices}"
            )
        return
    budget = n_devices
    if mode.kind == "decoupled":
        n_gen, n_rest = mode.gen.world_size, mode.rest_n_devices()
        if n_gen + n_rest != n_devices:
            raise AllocationError(
                f"allocation mode {whole!r}: generation uses {n_gen} devices and the rest uses {n_rest}, "
                f"{n_gen + n_rest} in all, but the experiment has {n_devices}; they must add up to {n_devices}"
            )
        budget = n_devices - n_gen
    layouts = dict(mode.per_mfc)
    if mode.default is not None:
        layouts[DEFAULT_KEY] = mode.default
    for name, layout in layouts.items():
        if layout.world_size > budget:
            where = "the non-generation devices" if mode.kind == "decoupled" else "the experiment"
            raise AllocationError(
                f"allocation mode {whole!r}: {name!r} layout {layout} uses {layout.world_size} devices but "
                f"{where} has only {budget}"
            )
    if mode.kind == "per_mfc" and max(d.world_size for d in layouts.values()) < budget:
        logger.warning("allocation mode %r uses at most %d of the %d devices", whole,
                       max(d.world_size for d in layouts.values()), budget)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def heuristic_layout(n_devices: int, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
                     min_model_parallel: int = 1) -> ParallelDims:
    """A sensible layout for ``n_devices``: data parallel as large as possible.

    ``min_model_parallel`` (tp * pp) is the smallest model-parallel degree needed to fit the model
    (1 by default: every device holds a full replica, which suits the small models this runs on
    CPU). Tensor parallelism is preferred (it must divide ``n_heads`` when given and stays <= 8,
    i.e. within a node); pipeline parallelism makes up the rest (``pp <= n_layers`` when given).
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"heuristic_layout: n_devices must be a positive integer, got {n_devices!r}")
    if min_model_parallel < 1:
        raise ValueError(f"heuristic_layout: min_model_parallel must be >= 1, got {min_model_parallel}")
    best = None
    for mp in _divisors(n_devices):
        if mp < min_model_parallel:
            continue
        for tp in sorted(_divisors(mp), reverse=True):
            pp = mp // tp
            if n_heads is not None and n_heads % tp:
                continue
            if tp > 8:
                continue
            if n_layers is not None and pp > n_layers:
                continue
            best = ParallelDims(dp=n_devices // mp, tp=tp, pp=pp)
            break
        if best is not None:
            break
    if best is None:
        raise ValueError(
            f"heuristic_layout: no layout of {n_devices} devices with model parallel >= {min_model_parallel} "
            f"fits n_heads={n_heads}, n_layers={n_layers}"
        )
    return best


# ----------------------------------------------------------------------------- device meshes
def node_names(n_nodes: int) -> List[str]:
    """Names of the cluster's nodes in device order: ``node01``, ``node02``, ... (a single node may also be
    called ``localhost``)."""
    return [f"node{i + 1:02d}" for i in range(n_nodes)]


def _device_ids(part: str, n: int, whole: str) -> List[int]:
    ids: List[int] = []
    for item in part.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise AllocationError(f"device mesh {whole!r}: {item!r} is not a device id or a range 'a-b'")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise AllocationError(f"device mesh {whole!r}: empty range {item!r}")
        ids += list(range(a, b + 1))
    bad = [i for i in ids if i >= n]
    if bad:
        raise AllocationError(f"device mesh {whole!r}: device ids {bad} do not exist; each node has devices 0..{n - 1}")
    return ids


def parse_device_mesh(s: str, n_nodes: int, n_devices_per_node: int) -> List[int]:
    """Global device slots (``node_index * n_devices_per_node + id``) of a mesh string.

    ``node01:0,1,2,3`` (ids and ranges ``0-3``), ``node01`` (every device of the node), several nodes joined
    by ``;`` (``node01;node02:0-3``). With one node, ``localhost`` names it too. A device listed twice is
    an error.
    """
    if not isinstance(s, str) or not s.strip():
        raise AllocationError("device mesh is empty; expected e.g. 'node01:0,1' or 'localhost:0-3'")
    names = node_names(n_nodes)
    out: List[int] = []
    for part in s.split(";"):
        node, sep, ids = part.strip().partition(":")
        node = node.strip()
        if node == "localhost" and n_nodes == 1:
            node = names[0]
        if node not in names:
            raise AllocationError(f"device mesh {s!r}: unknown node {node!r}; nodes are {names}"
                                  + (" (or 'localhost')" if n_nodes == 1 else ""))
        base = names.index(node) * n_devices_per_node
        local = _device_ids(ids, n_devices_per_node, s) if sep else list(range(n_devices_per_node))
        out += [base + i for i in local]
    dup = sorted({d for d in out if out.count(d) > 1})
    if dup:
        raise AllocationError(f"device mesh {s!r} lists devices {dup} more than once")
    return out
