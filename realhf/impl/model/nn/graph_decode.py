"""The decode step replayed as a CUDA graph.

On a GPU, a decode step of a small model at rollout batch sizes is bound by the host, not the device: SmolLM2
(30 layers) launches about 1,000 kernels a step, and on the H200 machine measured here the step took 55 ms of
host time for 2.8 ms of GPU work, in realhf and ``transformers`` alike (``benchmarks/bench_scale.py
--compare-transformers --shape smollm2 --profile-decode 32``). Capturing the step once as a CUDA graph and
replaying it launches the whole step at once.

The captured step is ``compiled_decode.static_step_fns``: it writes each row's new key/value at ``lens[row]`` and
attends over the cache's whole length with a mask, so its shapes and buffers do not change from step to step
(the price: attention reads the whole cache length every step, not only the positions filled so far, which is
small next to the weights at the lengths RL rollouts use). A graph is tied to the buffers it was captured
on: the cache's keys/values and ``lens``, and this decoder's own buffers for the step's token ids, banned-token
mask and per-row random numbers, which each call copies its inputs into. When the cache's buffers change (rows
were dropped), the next call captures a new graph; ``generate`` therefore keeps finished rows in the batch until
at most half the rows still run (``keeps_finished_rows``), so a generation captures O(log rows) graphs.

The first call for new buffers runs the step eagerly on a side stream (the warm-up PyTorch asks for before a
capture; its result is that step's answer, so nothing is computed twice), then captures; later calls replay.
If capturing fails, the decoder logs why once and returns None from then on, and ``generate`` runs the eager
step. Used by ``generate`` on CUDA for a single-stage model without tensor parallelism, unless
``GenerationHyperparameters.cuda_graph`` is off.

``GraphDecoder(model, capture=False)`` runs the same bookkeeping with "replay" re-executing the step on the
static buffers: the CPU tests check the buffer handling with it (a graph replays the recorded kernels on the
same buffers, which computes what re-running the step on them computes).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from realhf.base import logging
from realhf.impl.model.nn.compiled_decode import _supported, static_step_fns

logger = logging.getLogger(__name__)

# counts over the process, for tests and benchmarks: graphs captured, replays, decoders that fell back to eager
STATS = {"captures": 0, "replays": 0, "failures": 0}


class _Entry:
    """One captured step: the graph, the inputs it reads (held, so the buffers outlive it), its outputs."""

    def __init__(self, graph, args: tuple, out):
        self.graph, self.args, self.out = graph, args, out


class GraphDecoder:
    """``decoder(ids [B], cache)`` -> logits [B, V]; ``decoder.sample(ids, cache, ban, row_u, greedy, temperature)``
    -> (tokens [B], log-probs [B]): one decode step of every cache row (a ``KVCache``: per-layer ``k``/``v``
    buffers and ``lens``), the new keys/values written at ``cache.lens``; the caller advances ``lens``.
    Returns None once capturing has failed (the caller then runs the eager step)."""

    kind = "graph"  # (decode_core.Decoder.kind)
    # ``generate`` keeps finished rows in the batch (their outputs ignored) while more than half still run
    keeps_finished_rows = True

    def __init__(self, model, capture: bool = True):
        self.model = model
        self.capture = capture
        self._step, self._step_sample = static_step_fns(model)
        self._entries: Dict[tuple, _Entry] = {}
        self._pool = None
        self.failed: Optional[str] = None
        self.captures = 0  # graphs captured (or, with capture=False, entries made)
        self.replays = 0

    # ------------------------------------------------------------ public
    def __call__(self, ids: torch.Tensor, cache) -> Optional[torch.Tensor]:
        key = ("logits", ids.shape[0]) + self._buffers_key(cache)
        out = self._run(key, self._step, lambda: (ids.clone(), cache.lens, cache.k, cache.v), ids)
        return None if out is None else out.clone()

    def sample(self, ids: torch.Tensor, cache, ban: torch.Tensor, row_u: Optional[torch.Tensor], greedy: bool,
               temperature: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        key = ("sample", ids.shape[0], row_u is None, bool(greedy), float(temperature)) + self._buffers_key(cache)

        def args():
            u = None if row_u is None else row_u.to(device=ids.device, dtype=torch.float64).clone()
            return (ids.clone(), cache.lens, cache.k, cache.v, ban.clone(), u, bool(greedy), float(temperature))

        def feed(entry: _Entry):
            entry.args[4].copy_(ban)
            if row_u is not None:
                entry.args[5].copy_(row_u, non_blocking=True)

        out = self._run(key, self._step_sample, args, ids, feed)
        return None if out is None else (out[0].clone(), out[1].clone())

    # ------------------------------------------------------------ internals
    @staticmethod
    def _buffers_key(cache) -> tuple:
        k0 = cache.k[0]
        return (k0.data_ptr(), tuple(k0.shape), cache.v[0].data_ptr(), cache.lens.data_ptr(), len(cache.k))

    def _run(self, key: tuple, fn: Callable, make_args: Callable[[], tuple], ids: torch.Tensor,
             feed: Optional[Callable[[_Entry], None]] = None):
        if self.failed is not None:
            return None
        entry = self._entries.get(key)
        if entry is not None:
            entry.args[0].copy_(ids)
            if feed is not None:
                feed(entry)
            if entry.graph is not None:
                entry.graph.replay()
                out = entry.out
            else:
                out = fn(*entry.args)
            self.replays += 1
            STATS["replays"] += 1
            return out
        # new buffers: graphs captured on other buffers will not serve again (graphs of other row counts over the
        # same buffers, views of their first rows, may: PaddedGraphDecoder's buckets)
        self._entries = {k: e for k, e in self._entries.items() if _pointers(k) == _pointers(key)}
        args = make_args()
        if not self.capture:
            self._entries[key] = _Entry(None, args, None)
            self.captures += 1
            return fn(*args)
        try:
            out, entry = self._capture(fn, args)
        except Exception as e:  # an op that cannot be captured: decode eagerly from now on
            self.failed = f"{type(e).__name__}: {e}"
            self._entries.clear()
            STATS["failures"] += 1
            logger.warning(f"CUDA graph of the decode step unavailable, decoding eagerly: {self.failed[:500]}")
            return None
        self._entries[key] = entry
        self.captures += 1
        STATS["captures"] += 1
        return out

    def reset(self) -> None:
        """Forget every captured graph (their buffers are about to be replaced)."""
        self._entries.clear()

    def _capture(self, fn: Callable, args: tuple):
        """Warm up (this step's answer) on a side stream, then capture ``fn(*args)`` into a graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn(*args)
            out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = fn(*args)
        return out, _Entry(graph, args, static_out)


def _pointers(key: tuple) -> tuple:
    """The buffers an entry's key names (``_buffers_key``'s addresses and layer count, not the shape)."""
    return key[-5], key[-3], key[-2], key[-1]


def decoder_for(model, capture: bool = True) -> Optional[GraphDecoder]:
    """A CUDA-graph decoder for ``model`` (one per generation), or None where unsupported (tensor or pipeline
    parallelism; with ``capture``, a model not on CUDA)."""
    why = _supported(model)
    if why is None and capture and not model.flat.is_cuda:
        why = f"device {model.device} (CUDA graphs need a CUDA device)"
    if why is not None:
        logger.debug(f"CUDA graph decode not used: {why}")
        return None
    return GraphDecoder(model, capture=capture)


# ---------------------------------------------------------------------------------------------------------------
# The generation server's running batch: rows join and leave every few steps, so a graph per row count would be
# captured over and over. PaddedGraphDecoder pads the batch to a few row counts over the slot storage instead.

def padded_rows(rows: int, capacity: int) -> int:
    """The row count a batch of ``rows`` running rows is padded to: the next power of two up to 32, then the next
    multiple of 32, at most ``capacity`` (the storage's rows, never fewer than ``rows``)."""
    if rows < 1 or rows > capacity:
        raise ValueError(f"{rows} running rows do not fit a storage of {capacity} rows")
    p = 1
    while p < rows and p < 32:
        p *= 2
    if p < rows:
        p = -(-rows // 32) * 32
    return min(p, capacity)


class _PaddedView:
    """What ``GraphDecoder`` reads of a cache: the first ``rows`` rows of the slot storage and of the lens buffer."""

    __slots__ = ("k", "v", "lens")

    def __init__(self, k, v, lens):
        self.k, self.v, self.lens = k, v, lens


class PaddedGraphDecoder:
    """``decoder(ids [B], cache)`` -> logits [B, V] (or None: decode eagerly) for a cache whose rows live in a
    preallocated storage (``cache.storage()`` -> per-layer key and value buffers ``[capacity, h_kv, positions, d]``,
    the running rows first; ``cache.lens`` [B]): the gen server's ``SlotCache``.

    The step runs over the storage's first ``padded_rows(B, capacity)`` rows, so a graph is captured once per
    (storage, padded row count) and replayed as rows join and leave. The padding rows are free slots: they get
    length 0, so the step writes a key/value at position 0 of each, which the next row to take the slot overwrites
    with its prompt (a row joining copies at least one position); their logits are dropped. A new storage (the
    cache grew) or new parameter storage (``model.flat`` rebound) drops the graphs. ``graphs``: the
    ``GraphDecoder`` that captures and replays (``capture=False`` re-runs the step: the CPU tests)."""

    kind = "graph"  # (decode_core.Decoder.kind)

    def __init__(self, graphs: GraphDecoder):
        self.model = graphs.model
        self.graphs = graphs
        self._key = None
        self._views: Dict[int, _PaddedView] = {}
        self._ids: Optional[torch.Tensor] = None
        self._lens: Optional[torch.Tensor] = None
        self.padded_steps = 0  # steps that ran with padding rows (tests, stats)

    @property
    def failed(self) -> Optional[str]:
        return self.graphs.failed

    @property
    def captures(self) -> int:
        return self.graphs.captures

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def __call__(self, ids: torch.Tensor, cache) -> Optional[torch.Tensor]:
        if self.graphs.failed is not None:
            return None
        ks, vs = cache.storage()
        B, cap = ids.shape[0], ks[0].shape[0]
        key = (ks[0].data_ptr(), tuple(ks[0].shape), vs[0].data_ptr(), len(ks), self.model.flat.data_ptr())
        if key != self._key:
            self.graphs.reset()
            self._key, self._views = key, {}
            self._ids = torch.zeros(cap, dtype=torch.long, device=ids.device)
            self._lens = torch.zeros(cap, dtype=torch.long, device=ids.device)
        P = padded_rows(B, cap)
        view = self._views.get(P)
        if view is None:
            view = self._views[P] = _PaddedView([k[:P] for k in ks], [v[:P] for v in vs], self._lens[:P])
        self._ids[:B].copy_(ids)
        self._lens[:B].copy_(cache.lens)
        if P > B:
            self._lens[B:P].zero_()  # ids there: any earlier token, a valid id
            self.padded_steps += 1
        out = self.graphs(self._ids[:P], view)
        return None if out is None else out[:B]


def padded_decoder_for(model, capture: bool = True) -> Optional[PaddedGraphDecoder]:
    """A ``PaddedGraphDecoder`` for ``model``, or None where unsupported (as ``decoder_for``)."""
    graphs = decoder_for(model, capture)
    return None if graphs is None else PaddedGraphDecoder(graphs)
