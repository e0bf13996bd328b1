"""Runtime benchmark: round trip of an empty MFC request (master -> N workers -> replies) over the real
authenticated ZMQ stream, and worker-to-worker tensor transfer through the data manager (gloo
point-to-point) next to a plain in-process copy of the same bytes; the master's work of encoding one MFC's requests
for many workers (``--encode``: each worker's own share, as the master sends them, beside the whole batch's plan,
metas and metadata to every worker). Prints JSON lines.

Usage: python benchmarks/bench_runtime.py [--workers 2] [--calls 200] [--mb 64,256] [--encode 512x64,4096x64]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch
from _timing import emit as _emit, inprocess_copy_seconds



def _serve(name, secret, q):
    from realhf.system.transport.request_reply_stream import Payload, WorkerServer

    srv = WorkerServer(name, secret, host="127.0.0.1")
    q.put(srv.address)
    while True:
        got = srv.poll(timeout=1.0)
        if got is None:
            continue
        peer, req = got
        srv.reply(peer, Payload(handler="master", handle_name=req.handle_name, request_id=req.request_id, data={}))
        if req.handle_name == "exit":
            break
    srv.close()


def bench_round_trip(n_workers: int, n_calls: int):
    from realhf.base.run_secret import new_run_secret
    from realhf.system.transport.request_reply_stream import MasterClient

    secret = new_run_secret()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(f"w{i}", secret, q), daemon=True) for i in range(n_workers)]
    for p in procs:
        p.start()
    addrs = {f"w{i}": q.get(timeout=60) for i in range(n_workers)}
    addrs = dict(zip(sorted(addrs), sorted(addrs.values())))
    client = MasterClient(secret, addrs)
    data = {w: {"mfc": "noop", "ids_by_dp": {"0": [str(i) for i in range(64)]}} for w in addrs}
    for _ in range(20):
        client.call("noop", data)
    ts = []
    for _ in range(n_calls):
        t = time.perf_counter()
        client.call("noop", data)
        ts.append(time.perf_counter() - t)
    client.call("exit", {w: {} for w in addrs})
    client.close()
    for p in procs:
        p.join(timeout=10)
    return statistics.median(ts), statistics.quantiles(ts, n=20)[18]


def _transfer(mb: int, reps: int):
    import torch.distributed as dist

    from realhf.api.core.data_api import SequenceSample
    from realhf.base.runtime_env import cpu_env
    from realhf.system.trainer.data_manager import DataManager

    rank = dist.get_rank()
    n = mb * 1024 * 1024 // 4
    dm = DataManager(rank, cpu_env().device)
    if rank == 0:
        dm.put(SequenceSample.from_default(ids=["s0"], seqlens=[n], data={"x": torch.randn(n)}))
    plan = [(0, 1, "s0", "x")]
    metas = {"s0": {"x": {"seqlens": [n], "trailing_shape": [], "dtype": "float32"}}}
    ts = []
    for i in range(reps + 1):
        dist.barrier()
        t = time.perf_counter()
        dm.execute(plan, metas)
        dist.barrier()
        if i:
            ts.append(time.perf_counter() - t)
        if rank == 1:
            dm.drop(["s0"])
    return statistics.median(ts)


def bench_encode(n: int, workers: int, reps: int) -> dict:
    """Seconds to build and sign one MFC's requests for ``workers`` data-parallel workers over ``n`` samples whose
    tensors the workers hold round-robin (so the plan moves most of them): each worker's share
    (``master_worker.mfc_requests``) and, for reference, the whole batch to every worker."""
    import os

    from realhf.base.wire import encode_payload
    from realhf.system.trainer.data_manager import plan_transfers
    from realhf.system.trainer.master_worker import mfc_requests
    from realhf.system.transport.request_reply_stream import Payload

    keys = ("packed_input_ids", "prompt_mask")
    ids = [f"{i:032x}" for i in range(n)]
    parts = [ids[d::workers] for d in range(workers)]
    owners = {sid: {k: i % workers for k in keys} for i, sid in enumerate(ids)}
    metas = {sid: {k: {"dtype": "int64", "seqlens": [[20 + i % 7]], "shape": []} for k in keys}
             for i, sid in enumerate(ids)}
    metadata = {sid: {"prompt_id": sid, "answer": str(i)} for i, sid in enumerate(ids)}
    dp_of = {r: r for r in range(workers)}
    plan = plan_transfers(owners, {r: parts[r] for r in dp_of}, keys)
    secret = os.urandom(32)

    def sign(reqs) -> int:
        return sum(len(f) for r, d in reqs.items()
                   for f in encode_payload(secret, Payload(handler=f"w{r}", handle_name="mfc", data=d)))

    def own():
        return sign(mfc_requests("mfc", plan, metas, parts, dp_of, metadata, set(dp_of)))

    def whole():
        moved = {}
        for _, _, sid, k in plan:
            moved.setdefault(sid, {})[k] = metas[sid][k]
        base = {"mfc": "mfc", "plan": [list(p) for p in plan], "metas": moved,
                "ids_by_dp": {str(d): p for d, p in enumerate(parts)}, "metadata": metadata}
        return sign({r: base for r in dp_of})

    out = dict(bench="mfc_request_encoding", samples=n, workers=workers)
    for name, fn in (("own_share", own), ("whole_batch_each", whole)):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            size = fn()
            ts.append(time.perf_counter() - t)
        out[f"{name}_ms"], out[f"{name}_mbytes"] = round(statistics.median(ts) * 1e3, 2), round(size / 2**20, 2)
    out["ratio"] = round(out["whole_batch_each_ms"] / out["own_share_ms"], 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--mb", default="16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--encode", default="512x8,512x64,512x256,4096x64",
                    help="SAMPLESxWORKERS cases of the master's request encoding ('' to skip)")
    a = ap.parse_args()
    for case in filter(None, a.encode.split(",")):
        n, w = (int(x) for x in case.split("x"))
        _emit(**bench_encode(n, w, a.reps))
    med, p95 = bench_round_trip(a.workers, a.calls)
    _emit(bench="empty_mfc_round_trip", workers=a.workers, median_ms=round(med * 1e3, 3), p95_ms=round(p95 * 1e3, 3))
    from realhf.testing import run_distributed

    for mb in [int(x) for x in a.mb.split(",")]:
        t = run_distributed(_transfer, 2, mb, a.reps)[0]
        c = inprocess_copy_seconds(mb * 1024 * 1024 // 4, a.reps)
        _emit(bench="worker_to_worker_transfer", mbytes=mb, seconds=round(t, 4), gbytes_per_s=round(mb / 1024 / t, 3),
              inprocess_copy_gbytes_per_s=round(mb / 1024 / c, 3), ratio_vs_copy=round(c / t, 4))


if __name__ == "__main__":
    sys.exit(main())
