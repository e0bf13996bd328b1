"""Runs a dataflow graph of MFCs over a set of samples, each MFC as soon as its inputs are ready.

An MFC is ready when the buffer holds every one of its input keys for every sample of the set (the dataset's
keys from the start, the others once the MFCs producing them have added their outputs). Ready MFCs run
concurrently in threads; ``run_mfc(mfc, ids)`` does the work (moving data, calling the workers) and adds the
outputs to the buffer. The first failure stops new MFCs from starting; running ones finish, then it is raised.
Nothing here knows about workers or sockets: it is tested with plain functions.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Dict, Iterable, List, Optional

from realhf.api.core.dfg import DataflowGraph, MFCDef
from realhf.system.trainer.buffer import SampleBuffer


class StuckGraph(RuntimeError):
    """No MFC can start and none is running, but some have not run: the buffer lacks their inputs."""


class DFGExecutor:
    def __init__(self, graph: DataflowGraph, buffer: SampleBuffer, run_mfc: Callable[[MFCDef, List[str]], dict]):
        self.graph, self.buffer, self.run_mfc = graph, buffer, run_mfc

    def run(self, ids: List[str], only: Optional[Iterable[str]] = None) -> Dict[str, dict]:
        """Run every MFC of the graph (or of ``only``, a part whose other inputs the buffer holds) once over ``ids``;
        returns {MFC name: what run_mfc returned}."""
        part = None if only is None else set(only)
        order = [n for n in self.graph.topological_order() if part is None or n in part]
        pending = list(order)
        running: Dict[Future, str] = {}
        results: Dict[str, dict] = {}
        error = None
        with ThreadPoolExecutor(max_workers=max(1, len(order)), thread_name_prefix="mfc") as pool:
            while pending or running:
                if error is None:
                    for name in [n for n in pending if self.buffer.has(ids, self.graph[n].buffer_input_keys)]:
                        pending.remove(name)
                        running[pool.submit(self.run_mfc, self.graph[name], ids)] = name
                if not running:
                    if error is not None:
                        break
                    waits = {n: self.buffer.missing(ids, self.graph[n].buffer_input_keys) for n in pending}
                    raise StuckGraph(f"no MFC can run: {', '.join(f'{n} waits for {k}' for n, k in waits.items())}")
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    name = running.pop(fut)
                    try:
                        results[name] = fut.result()
                    except BaseException as e:  # raised below, after the running MFCs finish
                        error = error or e
        if error is not None:
            raise error
        return results
