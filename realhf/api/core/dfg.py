"""Model function calls (MFCs) and the dataflow graph (DFG) they form.

An :class:`MFCDef` is declarative: which model, which interface method, which keys it reads and
which it writes. :func:`build_graph` infers the edges from the keys: an MFC that reads key ``k``
depends on the MFC that writes ``k``, or on the dataset when no MFC writes it.

Key names. ``input_keys`` / ``output_keys`` are the names the *interface* sees. The remaps
translate them to the names used in the buffer (and in the graph), in the same direction for both:
``input_key_remap = {interface_name: buffer_name}`` and ``output_key_remap = {interface_name:
buffer_name}``; a key absent from a remap has the same name on both sides. Example: a reference
model whose interface returns ``logprobs`` stored as ``packed_ref_logprobs`` has
``output_keys=("logprobs",), output_key_remap={"logprobs": "packed_ref_logprobs"}``.
Use :attr:`MFCDef.buffer_input_keys` / :attr:`MFCDef.buffer_output_keys` and the mapping helpers
rather than applying the remaps by hand.
"""
from __future__ import annotations

import dataclasses
import enum
import heapq
from typing import Any, Iterable

from realhf.base import logging

logger = logging.getLogger(__name__)


class ModelInterfaceType(enum.Enum):
    GENERATE = "generate"
    TRAIN_STEP = "train_step"
    INFERENCE = "inference"
    EVALUATE = "evaluate"


@dataclasses.dataclass(frozen=True, order=True)
class ModelName:
    """A model replica: ``role`` (e.g. ``actor``) and ``replica_id``. ``str()`` gives ``actor`` for
    replica 0 and ``actor@1`` otherwise; :meth:`parse` reads both forms (and ``actor@0``)."""

    role: str
    replica_id: int = 0

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role or "@" in self.role:
            raise ValueError(f"ModelName role must be a non-empty str without '@', got {self.role!r}")
        if not isinstance(self.replica_id, int) or isinstance(self.replica_id, bool) or self.replica_id < 0:
            raise ValueError(f"ModelName replica_id must be an int >= 0, got {self.replica_id!r}")

    def __str__(self) -> str:
        return self.role if self.replica_id == 0 else f"{self.role}@{self.replica_id}"

    @classmethod
    def parse(cls, s: "str | ModelName") -> "ModelName":
        if isinstance(s, ModelName):
            return s
        if not isinstance(s, str):
            raise ValueError(f"cannot parse a ModelName from {s!r}")
        role, sep, rep = s.partition("@")
        if not sep:
            return cls(role)
        if not rep.isdigit():
            raise ValueError(f"bad ModelName {s!r}: expected 'role' or 'role@<int>'")
        return cls(role, int(rep))


@dataclasses.dataclass
class MicroBatchSpec:
    """How an MFC cuts its per-rank batch: at least ``n_mbs`` micro-batches, each within
    ``max_tokens_per_mb`` tokens (a single longer sample goes alone)."""

    n_mbs: int = 1
    max_tokens_per_mb: int = 2**31 - 1

    def __post_init__(self):
        for f in ("n_mbs", "max_tokens_per_mb"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MicroBatchSpec.{f} must be an int >= 1, got {v!r}")


def _check_remap(mfc: str, which: str, keys: tuple, remap: dict) -> None:
    extra = set(remap) - set(keys)
    if extra:
        raise ValueError(
            f"MFC {mfc!r}: {which}_key_remap renames {sorted(extra)}, which are not in {which}_keys {list(keys)}"
        )
    names = [remap.get(k, k) for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"MFC {mfc!r}: {which}_keys {list(keys)} with remap {remap} give duplicate buffer names {names}")


@dataclasses.dataclass
class MFCDef:
    """One model function call of the DFG (see the module docstring for key naming).

    ``interface_args`` are the keyword arguments of the registered interface ``interface_impl``: the
    experiment's typed config objects as the CLI validated them (e.g. ``PPOHyperparameters``), never a
    hand-copied dict of their fields. Every MFC runs on the whole batch of a step (the dataset's
    ``batch_size`` prompts); ``mb_spec`` cuts each rank's share into micro-batches."""

    name: str
    model_name: ModelName | str
    interface_type: ModelInterfaceType | str
    interface_impl: str
    interface_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    input_keys: tuple[str, ...] = ()
    output_keys: tuple[str, ...] = ()
    input_key_remap: dict[str, str] = dataclasses.field(default_factory=dict)
    output_key_remap: dict[str, str] = dataclasses.field(default_factory=dict)
    mb_spec: MicroBatchSpec = dataclasses.field(default_factory=MicroBatchSpec)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MFC name must be a non-empty str, got {self.name!r}")
        self.model_name = ModelName.parse(self.model_name)
        if isinstance(self.interface_type, str):
            try:
                self.interface_type = ModelInterfaceType(self.interface_type)
            except ValueError:
                allowed = [t.value for t in ModelInterfaceType]
                raise ValueError(
                    f"MFC {self.name!r}: interface_type {self.interface_type!r} is not one of {allowed}"
                ) from None
        if not isinstance(self.interface_type, ModelInterfaceType):
            raise ValueError(f"MFC {self.name!r}: interface_type must be a ModelInterfaceType, got {self.interface_type!r}")
        if not isinstance(self.interface_impl, str) or not self.interface_impl:
            raise ValueError(f"MFC {self.name!r}: interface_impl must be a registered interface name (non-empty str)")
        if not isinstance(self.interface_args, dict):
            raise ValueError(f"MFC {self.name!r}: interface_args must be a dict")
        for f in ("input_keys", "output_keys"):
            v = getattr(self, f)
            if isinstance(v, str):
                raise ValueError(f"MFC {self.name!r}: {f} must be a sequence of key names, not the str {v!r}")
            v = tuple(v)
            if not all(isinstance(k, str) and k for k in v):
                raise ValueError(f"MFC {self.name!r}: {f} must hold non-empty str, got {v}")
            if len(set(v)) != len(v):
                raise ValueError(f"MFC {self.name!r}: {f} lists a key twice: {v}")
            setattr(self, f, v)
        _check_remap(self.name, "input", self.input_keys, self.input_key_remap)
        _check_remap(self.name, "output", self.output_keys, self.output_key_remap)
        if not isinstance(self.mb_spec, MicroBatchSpec):
            raise ValueError(f"MFC {self.name!r}: mb_spec must be a MicroBatchSpec, got {self.mb_spec!r}")

    @property
    def role(self) -> str:
        return self.model_name.role

    @property
    def is_train(self) -> bool:
        return self.interface_type == ModelInterfaceType.TRAIN_STEP

    @property
    def is_generate(self) -> bool:
        return self.interface_type == ModelInterfaceType.GENERATE

    @property
    def is_inference(self) -> bool:
        return self.interface_type == ModelInterfaceType.INFERENCE

    @property
    def is_evaluate(self) -> bool:
        return self.interface_type == ModelInterfaceType.EVALUATE

    @property
    def buffer_input_keys(self) -> tuple[str, ...]:
        """Input keys under their buffer (graph) names."""
        return tuple(self.input_key_remap.get(k, k) for k in self.input_keys)

    @property
    def buffer_output_keys(self) -> tuple[str, ...]:
        """Output keys under their buffer (graph) names."""
        return tuple(self.output_key_remap.get(k, k) for k in self.output_keys)

    def input_buffer_to_interface(self) -> dict[str, str]:
        """``{buffer_name: interface_name}`` for renaming loaded inputs before the call."""
        return {self.input_key_remap.get(k, k): k for k in self.input_keys}

    def output_interface_to_buffer(self) -> dict[str, str]:
        """``{interface_name: buffer_name}`` for renaming results before they are stored."""
        return {k: self.output_key_remap.get(k, k) for k in self.output_keys}


class DataflowGraph:
    """The DFG of a set of MFCs; build it with :func:`build_graph`. Queries take MFC names."""

    def __init__(self, mfcs: list[MFCDef], dataset_keys: set[str], producers: dict[str, str], order: list[str]):
        self.mfcs: dict[str, MFCDef] = {m.name: m for m in mfcs}
        self.dataset_keys: frozenset[str] = frozenset(dataset_keys)
        self._producers = dict(producers)
        self._order = list(order)
        pos = {n: i for i, n in enumerate(order)}
        self._parents: dict[str, list[str]] = {}
        self._children: dict[str, list[str]] = {n: [] for n in order}
        self._edge_keys: dict[tuple[str, str], tuple[str, ...]] = {}
        for m in mfcs:
            ps: dict[str, list[str]] = {}
            for k in m.buffer_input_keys:
                if k in self._producers:
                    ps.setdefault(self._producers[k], []).append(k)
            self._parents[m.name] = sorted(ps, key=pos.__getitem__)
            for p, ks in ps.items():
                self._edge_keys[(p, m.name)] = tuple(ks)
        for (p, c) in self._edge_keys:
            self._children[p].append(c)
        for n in self._children:
            self._children[n].sort(key=pos.__getitem__)
        self._ancestors: dict[str, frozenset[str]] = {}
        for n in order:
            anc: set[str] = set()
            for p in self._parents[n]:
                anc.add(p)
                anc |= self._ancestors[p]
            self._ancestors[n] = frozenset(anc)

    def _name(self, mfc: "str | MFCDef") -> str:
        name = mfc.name if isinstance(mfc, MFCDef) else mfc
        if name not in self.mfcs:
            raise KeyError(f"no MFC named {name!r}; MFCs: {list(self.mfcs)}")
        return name

    def __len__(self) -> int:
        return len(self.mfcs)

    def __iter__(self):
        return (self.mfcs[n] for n in self._order)

    def __getitem__(self, name: str) -> MFCDef:
        return self.mfcs[self._name(name)]

    def topological_order(self) -> list[str]:
        """MFC names, every producer before its consumers; ties keep the order MFCs were given."""
        return list(self._order)

    def parents(self, mfc: "str | MFCDef") -> list[str]:
        return list(self._parents[self._name(mfc)])

    def children(self, mfc: "str | MFCDef") -> list[str]:
        return list(self._children[self._name(mfc)])

    def edges(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """``(producer, consumer, keys)`` for every edge, in topological order of the consumer."""
        pos = {n: i for i, n in enumerate(self._order)}
        return sorted(((p, c, ks) for (p, c), ks in self._edge_keys.items()), key=lambda e: (pos[e[1]], pos[e[0]]))

    def edge_keys(self, producer: str, consumer: str) -> tuple[str, ...]:
        return self._edge_keys.get((self._name(producer), self._name(consumer)), ())

    @property
    def sources(self) -> list[str]:
        """MFCs whose inputs all come from the dataset."""
        return [n for n in self._order if not self._parents[n]]

    @property
    def sinks(self) -> list[str]:
        """MFCs whose outputs no MFC consumes (e.g. train steps)."""
        return [n for n in self._order if not self._children[n]]

    def producer_of(self, key: str) -> str | None:
        """The MFC producing ``key``, or None when the dataset provides it."""
        if key in self._producers:
            return self._producers[key]
        if key in self.dataset_keys:
            return None
        raise KeyError(f"key {key!r} is produced by no MFC and not provided by the dataset")

    def dataset_keys_of(self, mfc: "str | MFCDef") -> set[str]:
        """Keys an MFC reads straight from the dataset."""
        m = self.mfcs[self._name(mfc)]
        return {k for k in m.buffer_input_keys if k not in self._producers}

    @property
    def used_dataset_keys(self) -> set[str]:
        """Dataset keys any MFC reads."""
        return set().union(*(self.dataset_keys_of(n) for n in self._order))

    def ancestors(self, mfc: "str | MFCDef") -> set[str]:
        return set(self._ancestors[self._name(mfc)])

    def descendants(self, mfc: "str | MFCDef") -> set[str]:
        n = self._name(mfc)
        return {m for m in self._order if n in self._ancestors[m]}

    def independent(self, a: "str | MFCDef", b: "str | MFCDef") -> bool:
        """True when neither MFC is an ancestor of the other (they may run concurrently)."""
        a, b = self._name(a), self._name(b)
        return a != b and a not in self._ancestors[b] and b not in self._ancestors[a]

    def describe(self) -> str:
        lines = [f"Dataflow graph: {len(self.mfcs)} MFCs, dataset keys {sorted(self.dataset_keys)}"]
        for n in self._order:
            m = self.mfcs[n]
            ins = []
            for k in m.buffer_input_keys:
                src = self._producers.get(k, "dataset")
                ins.append(f"{k}<-{src}")
            lines.append(
                f"  {n} [{m.model_name} {m.interface_type.value} {m.interface_impl}]: "
                f"in({', '.join(ins) or '-'}) out({', '.join(m.buffer_output_keys) or '-'}) "
                f"children({', '.join(self._children[n]) or '-'})"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DataflowGraph({self._order})"


def _find_cycle(nodes: Iterable[str], succ: dict[str, list[str]]) -> list[str]:
    """A cycle among ``nodes`` (all of which lie on or lead into cycles), as a closed path."""
    nodes = list(nodes)
    start = nodes[0]
    path, seen = [start], {start: 0}
    cur = start
    while True:
        nxt = next(c for c in succ[cur] if c in set(nodes))
        if nxt in seen:
            return path[seen[nxt] :] + [nxt]
        seen[nxt] = len(path)
        path.append(nxt)
        cur = nxt


def build_graph(mfcs: list[MFCDef], dataset_keys: Iterable[str]) -> DataflowGraph:
    """Infer the DFG of ``mfcs`` from their keys; raise ValueError on any inconsistency."""
    mfcs = list(mfcs)
    dataset_keys = set(dataset_keys)
    if not mfcs:
        raise ValueError("a dataflow graph needs at least one MFC")
    names = [m.name for m in mfcs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate MFC names: {dup}")
    for m in mfcs:
        if not isinstance(m, MFCDef):
            raise ValueError(f"build_graph takes MFCDef objects, got {type(m).__name__}")
    producers: dict[str, str] = {}
    for m in mfcs:
        for k in m.buffer_output_keys:
            if k in producers:
                raise ValueError(f"key {k!r} is produced by two MFCs: {producers[k]!r} and {m.name!r}")
            if k in dataset_keys:
                raise ValueError(f"key {k!r} is produced by MFC {m.name!r} but also provided by the dataset")
            producers[k] = m.name
    missing: dict[str, list[str]] = {}
    for m in mfcs:
        for k in m.buffer_input_keys:
            if k not in producers and k not in dataset_keys:
                missing.setdefault(k, []).append(m.name)
    if missing:
        what = "; ".join(f"key {k!r} needed by {v}" for k, v in sorted(missing.items()))
        raise ValueError(
            f"{what}: no MFC produces it and the dataset does not provide it. "
            f"Dataset keys: {sorted(dataset_keys)}; MFC outputs: {sorted(producers)}"
        )
    # Kahn's algorithm; ties broken by the order the MFCs were given (deterministic).
    pos = {n: i for i, n in enumerate(names)}
    succ: dict[str, list[str]] = {n: [] for n in names}
    indeg = {n: 0 for n in names}
    for m in mfcs:
        ps = {producers[k] for k in m.buffer_input_keys if k in producers}
        for p in sorted(ps, key=pos.__getitem__):
            succ[p].append(m.name)
            indeg[m.name] += 1
    heap = [pos[n] for n in names if indeg[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        n = names[heapq.heappop(heap)]
        order.append(n)
        for c in succ[n]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, pos[c])
    if len(order) != len(names):
        left = [n for n in names if n not in set(order)]
        # Restrict to nodes that still have a predecessor left, so the walk always continues.
        pred_left = {n: [p for p in left if n in succ[p]] for n in left}
        # Walk backwards through predecessors, which always exist for remaining nodes.
        cyc = _find_cycle(left, pred_left)[::-1]
        raise ValueError(f"the dataflow graph has a cycle: {' -> '.join(cyc)} (MFCs involved: {sorted(set(cyc))})")
    graph = DataflowGraph(mfcs, dataset_keys, producers, order)
    logger.debug(graph.describe())
    return graph
