"""The fixed cost of a model function call (MFC) outside its computation, measured on the real request/reply stream
(:mod:`realhf.system.transport.request_reply_stream`): a master's client sends an MFC-sized request (the sample ids,
their metadata and the transfer plan, as the master worker sends them) from a thread of a pool, as the master's DFG
executor does, to a worker server in another process, which answers at once with an output header of the same
samples. The mean round trip, with the master idle between calls as it is between a step's MFCs, is what every MFC
pays beside its work; a step pays two more (fetching the batch, clearing it).

Passed to :func:`realhf.plan.profile.profile` by the planner and ``python -m realhf.apps.profile``; returns plain
numbers.
"""
from __future__ import annotations

import os
import statistics
import time
import uuid
from typing import Dict

from realhf.base import logging

logger = logging.getLogger("realhf.system.transport.call_probe")

PROBE_SEQS = 32  # samples named in a probed request: a small batch's worth
PROBE_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask")


def _request(n_seqs: int) -> Dict:
    """An ``mfc`` request's data for ``n_seqs`` samples of one data-parallel rank, shaped as the master worker's
    (:func:`realhf.system.trainer.master_worker.mfc_requests`: the metas of the tensors it receives)."""
    ids = [uuid.uuid4().hex for _ in range(n_seqs)]
    metas = {i: {k: {"dtype": "int64", "seqlens": [[20]], "shape": []} for k in PROBE_KEYS[:1]} for i in ids}
    return {"mfc": "probe", "plan": [[0, 1, i, k] for i in ids for k in PROBE_KEYS[:1]], "metas": metas,
            "ids_by_dp": {"0": ids}, "metadata": {i: {"prompt_id": i, "answer": "1"} for i in ids}}


def _serve(secret: bytes, q) -> None:
    """The worker's end: answer each request with an output header of its samples until ``exit``."""
    from realhf.system.transport.request_reply_stream import WorkerServer

    server = WorkerServer("plan-probe-worker", secret, "127.0.0.1")
    q.put(server.address)
    try:
        while True:
            got = server.poll(timeout=1.0)
            if got is None:
                continue
            peer, req = got
            ids = req.data.get("ids_by_dp", {}).get("0", [])
            out = {"ids": ids, "keys": list(PROBE_KEYS), "seqlens": {k: [[20]] * len(ids) for k in PROBE_KEYS},
                   "metadata": req.data.get("metadata", {})}
            server.handle(peer, req, lambda r: {"seconds": 0.0, "output": out})
            if req.handle_name == "exit":
                return
    finally:
        server.close()


def mfc_round_trip(n_seqs: int = PROBE_SEQS, reps: int = 30, gap_s: float = 0.005, timeout: float = 60.0) -> float:
    """Mean seconds of an MFC request's round trip between two local processes over the real stream (module
    docstring), ``gap_s`` idle between calls."""
    import multiprocessing as mp
    from concurrent.futures import ThreadPoolExecutor

    from realhf.system.transport.request_reply_stream import MasterClient

    secret = os.urandom(32)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(secret, q), daemon=True)
    proc.start()
    try:
        addr = q.get(timeout=timeout)
        client = MasterClient(secret, {"w": addr})
        data = _request(n_seqs)

        def one() -> float:
            t = time.perf_counter()
            client.call("mfc", {"w": data}, timeout=timeout)
            return time.perf_counter() - t

        ts = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfc") as pool:
            for i in range(reps + 3):
                t = pool.submit(one).result()
                if i >= 3:  # the first calls connect and warm up
                    ts.append(t)
                time.sleep(gap_s)
        client.call("exit", {"w": {}}, timeout=timeout)
        client.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    return statistics.mean(ts)
