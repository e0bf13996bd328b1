"""Run a function on N real processes joined by a process group (tests, benchmarks, demos).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` (the CPU runtime environment's gloo, or the backend of the ``runtime_env`` each rank
is given; rendezvous through a TCP store this process serves on 127.0.0.1) in each, calls ``fn(*args)`` and returns the list of per-rank
return values. A rank that raises makes the whole call raise with that rank's
traceback; a rank that dies or hangs is reported after ``timeout`` seconds; no process is left behind.
``fn`` must be importable by name (module level) because processes are spawned.

The ranks start from a forkserver that has torch imported already (:func:`_rank_context`): 0.1 s a rank instead of
2-3 s of imports, and no interpreter shutdown at their exit. Each rank takes this process's environment variables
as they are at the call (a forkserver's children would otherwise have the server's).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, List, Optional


def free_port() -> int:
    """A port that was free a moment ago (another process may take it before it is bound again: for servers that
    report their own bind errors; rendezvous stores use :func:`rendezvous_store`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_store(world_size: int, timeout: float = 300.0):
    """A torch.distributed ``TCPStore`` server on 127.0.0.1 bound to a port the system picks (``store.port``), with
    no window in which another process can take the port (as picking a free port and binding it later has: seen
    as EADDRINUSE in CI). Keep it alive while the group runs; ranks join it with ``join_store``."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout: float = 300.0):
    """A client of the ``rendezvous_store`` listening on ``port``."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=timeout))


class DistributedError(RuntimeError):
    pass


# third-party modules only: the server imports them with its own sys.path (Python 3.11 applies the caller's only to
# the children), and each rank then imports realhf from the caller's sys.path
_PRELOAD = ["torch", "torch.distributed"]


def _rank_context():
    """multiprocessing's forkserver context, the server importing ``_PRELOAD`` once (it runs no torch op, so no
    thread pool or device state is forked). Where this platform has no forkserver: spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, kwargs, q, threads, timeout, runtime_env, environ=None):
    import faulthandler

    if environ is not None:  # the caller's environment at the call, not the forkserver's
        os.environ.clear()
        os.environ.update(environ)

    # if this rank hangs, its stack shows up in the log before the parent kills it
    faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
    try:
        import torch
        import torch.distributed as dist

        from realhf.base.runtime_env import cpu_env

        torch.set_num_threads(threads)
        os.environ["REALHF_TEST_RANK"] = str(rank)
        env = runtime_env(local_rank=rank) if runtime_env is not None else cpu_env()
        env.activate()
        dist.init_process_group(env.backend, store=join_store(port, world_size, timeout), rank=rank,
                                 world_size=world_size)
        try:
            out = fn(*args, runtime_env=env, **kwargs) if runtime_env is not None else fn(*args, **kwargs)
        finally:
            try:
                dist.barrier()
            except Exception:  # a peer already failed; its error is what matters
                pass
            dist.destroy_process_group()
        # plain pickle: tensors travel by value (torch's queue reducers would share memory that dies with us)
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure, including KeyboardInterrupt/SystemExit, to the parent
        q.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable, world_size: int, *args, timeout: float = 300.0, threads: int = 1,
    runtime_env: Optional[Callable[..., Any]] = None, **kwargs
) -> List[Any]:
    """``runtime_env``: a picklable callable ``runtime_env(local_rank=rank) -> RuntimeEnv`` (e.g.
    ``realhf.base.runtime_env.detect``) that makes each rank's environment; the rank's process group uses
    its backend, and ``fn`` receives it as the keyword ``runtime_env``. Without it every rank runs in the
    CPU environment (gloo) and ``fn`` gets only ``args``/``kwargs``."""
    ctx = _rank_context()
    q = ctx.Queue()
    store = rendezvous_store(world_size, timeout)  # served from this process until every rank is done
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, q, threads, timeout, runtime_env,
                                          dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, val = q.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    # give siblings a moment to report their own errors
                    time.sleep(0.5)
                    raise DistributedError(
                        f"rank(s) {dead} of {world_size} died with exit code(s) "
                        f"{[procs[i].exitcode for i in dead]} before reporting a result"
                    )
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise DistributedError(f"rank(s) {missing} of {world_size} did not finish within {timeout:.0f} s")
                continue
            if not ok:
                raise DistributedError(f"rank {rank} of {world_size} raised:\n{val}")
            results[rank] = pickle.loads(val)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def run_quickstart(args, timeout: float = 400.0, env=None):
    """``python -m realhf.apps.quickstart *args`` in a child process that imports this source tree; returns
    the ``subprocess.CompletedProcess`` (text output captured). ``env``: environment variables to set, or to
    remove where the value is None."""
    import subprocess
    import sys

    from realhf.base.process import env_with_source_path, source_root

    full = env_with_source_path()
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *args], cwd=source_root(),
                          capture_output=True, text=True, timeout=timeout, env=full)


def read_stats(fileroot: str, experiment: str, trial: str = "trial0") -> List[dict]:
    """The rows of a run's ``stats.jsonl``."""
    import json

    with open(os.path.join(fileroot, experiment, trial, "logs", "stats.jsonl")) as f:
        return [json.loads(line) for line in f]


def start_quickstart(args, env=None, ignored_signals=()):
    """``python -m realhf.apps.quickstart *args`` started in the background in its own session (so a test can
    signal it like a terminal would); output captured as text. ``ignored_signals`` start ignored (as a shell's
    ``cmd &`` leaves SIGINT, and ``nohup`` SIGHUP); the others start with their default action, whatever this process
    inherited (a test suite run under ``nohup`` would otherwise pass SIGHUP ignored on to every launch). Returns the
    ``subprocess.Popen``."""
    import signal
    import subprocess
    import sys

    from realhf.base.process import env_with_source_path, source_root

    full = env_with_source_path()
    full.update(env or {})
    started = time.time()

    def set_signals():
        for s in (signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN if s in ignored_signals else signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-m", "realhf.apps.quickstart", *args], cwd=source_root(), env=full,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=set_signals)
    p.started_at = started
    return p


def wait_for_steps(fileroot: str, experiment: str, n: int, timeout: float = 180.0, proc=None, trial: str = "trial0"):
    """Wait until the run's ``stats.jsonl`` has ``n`` rows; AssertionError after ``timeout`` s or when ``proc`` (the
    launcher, from :func:`start_quickstart`) ends first. Rows of an earlier run (a file not written since ``proc``
    started) do not count."""
    path = os.path.join(fileroot, experiment, trial, "logs", "stats.jsonl")
    since = getattr(proc, "started_at", 0.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getmtime(path) >= since:
            with open(path) as f:
                if sum(1 for _ in f) >= n:
                    return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {n}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} rows within {timeout:.0f} s")


def run_processes(fileroot: str) -> list:
    """The live processes (psutil) whose command line mentions ``fileroot``: a run's launcher, master and workers."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(fileroot in a for a in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def run_worker(fileroot: str, rank: int):
    """The process (psutil) of model worker ``rank`` of the run under ``fileroot``."""
    found = [p for p in run_processes(fileroot) if "--rank" in p.cmdline()
             and p.cmdline()[p.cmdline().index("--rank") + 1] == str(rank)]
    assert len(found) == 1, f"model worker {rank} of the run under {fileroot}: found {found}"
    return found[0]


def wait_until_gone(fileroot: str, timeout: float = 30.0) -> list:
    """Wait up to ``timeout`` s for every process of the run under ``fileroot`` to end; returns those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = run_processes(fileroot)
        if not left:
            return []
        time.sleep(0.2)
    return run_processes(fileroot)


def write_sum_rows(path: str, n: int = 16) -> None:
    """``n`` SFT rows ``{"prompt": "a+b=", "answer": "a+b"}`` (one-digit a, b) for short test runs."""
    import json

    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i % 10}+{i // 10}=", "answer": str(i % 10 + i // 10)}) + "\n")


def sft_cmd(model: str, data_dir: str, root: str, exp: str, *extra: str) -> list:
    """An ``sft`` quickstart command line over ``<data_dir>/train.jsonl`` (see :func:`write_sum_rows`), 4 sequences a
    step, on a tiny model with 512 positions; ``extra`` options are appended (later ones win)."""
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={data_dir}/train.jsonl",
            "dataset.train_bs_n_seqs=4", f"fileroot={root}", f"experiment_name={exp}", *extra]


def perturbed_model(hf_path: str, out_dir: str, seed: int, scale: float = 0.05):
    """(ReaLModel of ``hf_path`` with every weight perturbed by ``scale``-sized noise of ``seed``, the HF folder it
    was saved to under ``out_dir``): a "trainer" after some steps, for checking weight updates of servers."""
    import torch

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    m = build_from_hf(hf_path, grid=single_process_grid(), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale)
    path = os.path.join(str(out_dir), f"perturbed{seed}")
    save_hf(m, path)
    return m, path


def sequence_logprobs(model, seqs: List[List[int]]) -> List[List[float]]:
    """Log-prob of every token after the first of each sequence under ``model`` (a ReaLModel, one process; one
    packed forward at temperature 1): what a trainer computes, to compare a server's ``logprobs`` with."""
    import torch

    from realhf.impl.model.nn.real_model import make_packed_input

    ids = torch.tensor([t for s in seqs for t in s], device=model.device)
    inp = make_packed_input([len(s) for s in seqs], device=model.device)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, inp).float(), -1)
    out, off = [], 0
    for s in seqs:
        out.append([float(lp[off + i, s[i + 1]]) for i in range(len(s) - 1)])
        off += len(s)
    return out


def tiny_arith_recipe():
    """``scripts/tiny_arith_learning.py`` as a module: the tiny-model arithmetic recipe the learning tests run."""
    import importlib.util

    from realhf.base.process import source_root

    spec = importlib.util.spec_from_file_location("tiny_arith_learning",
                                                  os.path.join(source_root(), "scripts", "tiny_arith_learning.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
