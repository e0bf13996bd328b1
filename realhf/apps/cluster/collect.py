"""How ``check_cluster`` gets one probe onto every node the run would use, per launcher: ``local`` (this process),
``ray`` (one task per alive node, pinned with ``NodeAffinitySchedulingStrategy``) and ``slurm`` (one ``srun`` step
with one task per node). Each call is bounded in time and turns what went wrong into a sentence in the report.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import List, Optional

from realhf.apps.cluster.probe import PROBE_TAG, SESSION_DIR, _ray_probe, probe, session_dir
from realhf.apps.cluster.report import Report, Request
from realhf.base import network
from realhf.scheduler.slurm import sinfo


# ----------------------------------------------------------------------------- collecting the probes
def _new_session() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def _cleanup(req: Request, session: str) -> None:
    shutil.rmtree(session_dir(req.fileroot, session), ignore_errors=True)
    try:
        os.rmdir(os.path.join(os.path.expanduser(req.fileroot), SESSION_DIR))  # only when no other check is running
    except OSError:
        pass


def collect_local(req: Request, session: str) -> Report:
    rep = Report(req)
    rep.nodes.append(probe(req.fileroot, session, 0, 1, req.timeout, host=network.worker_host()))
    return rep


def _run_with_timeout(fn, timeout: float):
    """(finished, result, exception) of ``fn()`` run in a daemon thread for at most ``timeout`` seconds."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # reported to the caller
            box["error"] = e

    th = threading.Thread(target=target, daemon=True, name="check-cluster-call")
    th.start()
    th.join(timeout)
    return not th.is_alive(), box.get("result"), box.get("error")


def collect_ray(req: Request, session: str) -> Report:
    if not req.ray_address:
        rep = collect_local(req, session)
        rep.notes.append("ray_address is empty: the run starts a private one-node Ray instance on this machine, so "
                         "this machine was checked; pass --ray-address host:port (or 'auto') to check a cluster.")
        return rep
    rep = Report(req)
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        rep.errors.append("mode=ray needs the ray package here: pip install 'realhf[ray]'.")
        return rep
    from realhf.base.process import env_with_source_path
    from realhf.scheduler.ray_launcher import connect

    done, _, err = _run_with_timeout(lambda: connect(req.ray_address, 0, 0), req.connect_timeout)
    # Ray 2.5x+: a head started while ~/.ray/auth_token exists requires the token; drivers must say so themselves
    auth = ("" if os.environ.get("RAY_AUTH_MODE") else
            " If the head uses Ray token auth (~/.ray/auth_token on the head), set RAY_AUTH_MODE=token here.")
    if not done:
        rep.stuck = True
        rep.errors.append(f"could not join the Ray cluster at {req.ray_address!r} within {req.connect_timeout:g} s "
                          "(ray.init did not return): check that the address is the head's GCS port "
                          f"(ray start --head --port ...) and that this machine can reach it.{auth}")
        return rep
    if err is not None:
        rep.errors.append(f"{err}. Start the cluster (scripts/ray_cluster.sh start) or fix --ray-address."
                          + (auth if "refused" not in str(err) else ""))
        return rep
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        env = {"PYTHONPATH": env_with_source_path()["PYTHONPATH"]}  # as the Ray launcher's jobs
        # _ray_probe lives in an imported module (never __main__), so Ray pickles it by reference
        remote = ray.remote(num_cpus=0, max_retries=0)(_ray_probe)
        refs = []
        for i, n in enumerate(alive):
            refs.append(remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                runtime_env={"env_vars": env}).remote(req.fileroot, session, i, len(alive), req.timeout))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=req.timeout + 60)
        for i, (n, ref) in enumerate(zip(alive, refs)):
            res = n.get("Resources", {})
            where = f"node {i} ({n.get('NodeManagerHostname', '?')}, {n.get('NodeManagerAddress', '?')})"
            ray_part = dict(ray_node_id=n["NodeID"], ray_cpus=res.get("CPU", 0.0), ray_gpus=res.get("GPU", 0.0))
            if ref not in ready:
                ray.cancel(ref, force=True)
                rep.errors.append(f"{where} did not run the probe within {req.timeout + 60:g} s: its Ray workers may "
                                  "not start (see the node's Ray logs, e.g. /tmp/ray/session_latest/logs).")
                rep.nodes.append(dict(index=i, hostname=n.get("NodeManagerHostname"), ip=n.get("NodeManagerAddress"),
                                      failed=True, **ray_part))
                continue
            try:
                rep.nodes.append(dict(ray.get(ref), **ray_part))
            except Exception as e:
                first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                rep.errors.append(f"the probe failed on {where}: {first}; every node needs the same Python "
                                  "environment with realhf installed (or the source tree on a shared file system).")
                rep.nodes.append(dict(index=i, hostname=n.get("NodeManagerHostname"), ip=n.get("NodeManagerAddress"),
                                      failed=True, **ray_part))
    finally:
        ray.shutdown()
    return rep


def _scancel_by_name(name: str) -> None:
    if shutil.which("scancel"):
        try:
            subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _sinfo_summary(partition: str) -> str:
    rows, _ = sinfo(partition, "%P %D %T %G")
    return f" (sinfo: partition nodes state gres: {'; '.join(rows)})" if rows else ""


def _slurm_preflight(req: Request) -> Optional[str]:
    """Why the probe step cannot run (the controller does not answer, no such partition, too few nodes), or None."""
    where = f"partition {req.partition!r}" if req.partition else "the default partition"
    rows, err = sinfo("", "%P %D %T %G")
    if err:
        conf = os.environ.get("SLURM_CONF") or "unset: /etc/slurm/slurm.conf"
        return (f"the Slurm controller does not answer ({err}): check SLURM_CONF ({conf}) and that slurmctld runs "
                "(scontrol ping).")
    name = lambda r: r.split()[0].rstrip("*")  # noqa: E731
    mine = [r for r in rows if (name(r) == req.partition if req.partition else r.split()[0].endswith("*"))]
    if req.partition and not mine:
        return (f"partition {req.partition!r} does not exist; partitions: {sorted({name(r) for r in rows})} "
                "(slurm.partition / --partition).")
    try:
        have = sum(int(r.split()[1]) for r in mine)
    except (IndexError, ValueError):
        return None
    if mine and have < req.nodes:
        return (f"{where} has {have} node(s) but the run needs {req.nodes} (n_nodes): lower n_nodes or choose a "
                f"larger partition (sinfo: partition nodes state gres: {'; '.join(mine)}).")
    return None


def slurm_command(req: Request, session: str, python: Optional[str] = None) -> List[str]:
    """The ``srun`` step that runs one probe per node."""
    n = req.nodes
    minutes = max(1, math.ceil((req.timeout + 120) / 60))
    cmd = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--job-name=realhf-check-{session}",
           f"--immediate={max(1, int(req.alloc_timeout))}", f"--time={minutes}", "--kill-on-bad-exit=0"]
    if req.partition:
        cmd.append(f"--partition={req.partition}")
    if req.account:
        cmd.append(f"--account={req.account}")
    if req.gpus_per_node:
        cmd.append(f"--gpus-per-node={req.gpus_per_node}")
    cmd += req.srun_args
    in_container = any(a.startswith("--container-image") for a in req.srun_args)
    py = python or ("python3" if in_container else sys.executable)
    cmd += [py, "-m", "realhf.apps.check_cluster", "--probe", "--fileroot", req.fileroot, "--session", session,
            "--expect", str(n), "--timeout", f"{req.timeout:g}"]
    if req.host_cmd:
        cmd += ["--host-cmd", req.host_cmd]
    return cmd


def collect_slurm(req: Request, session: str) -> Report:
    from realhf.base.process import env_with_source_path

    rep = Report(req)
    if not shutil.which("srun"):
        rep.errors.append("srun is not on PATH: run check_cluster on a Slurm login node (the Slurm client installed, "
                          "SLURM_CONF pointing at the cluster's slurm.conf).")
        return rep
    why = _slurm_preflight(req)
    if why:
        rep.errors.append(why)
        return rep
    where = f"partition {req.partition!r}" if req.partition else "the default partition"
    cmd = slurm_command(req, session)
    name = f"realhf-check-{session}"
    limit = req.alloc_timeout + req.timeout + 60
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env_with_source_path())
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _scancel_by_name(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        rep.errors.append(f"the Slurm probe step did not finish within {limit:g} s and was cancelled (job name {name})"
                          f"{_sinfo_summary(req.partition)}: check the partition's state and the nodes' health, or "
                          "raise --alloc-timeout/--timeout.")
    for line in out.splitlines():
        if line.startswith(PROBE_TAG):
            try:
                rep.nodes.append(json.loads(line[len(PROBE_TAG):]))
            except ValueError:
                pass
    rep.nodes.sort(key=lambda x: x.get("index", 0))
    if not rep.errors and proc.returncode != 0 and len(rep.nodes) < req.nodes:
        msg = " ".join(line.strip() for line in err.splitlines() if line.strip() and "srun: " in line)[-600:]
        msg = msg or err.strip()[-600:] or f"exit code {proc.returncode}"
        if "invalid account" in err.lower():
            rep.errors.append(f"Slurm refused the account {req.account!r} ({msg}): set slurm.account / --account to "
                              "one you may charge (sacctmgr show assoc user=$USER).")
        elif "nable to allocate" in err or "not available" in err or "temporarily unavailable" in err:
            gpus = f" with {req.gpus_per_node} GPU(s) each" if req.gpus_per_node else ""
            rep.errors.append(f"Slurm did not give {req.nodes} node(s){gpus} in {where} within {req.alloc_timeout:g} s "
                              f"({msg}){_sinfo_summary(req.partition)}: lower n_nodes/GPUs, choose another "
                              "partition, or raise --alloc-timeout when the cluster is busy.")
        else:
            rep.errors.append(f"the Slurm probe step failed ({msg}): check the srun flags (partition, account, "
                              "container) and that every node has the same Python environment with realhf.")
    rep.notes.append("srun: " + " ".join(shlex.quote(c) for c in cmd))
    return rep


def collect(req: Request) -> Report:
    session = _new_session()
    try:
        rep = {"local": collect_local, "ray": collect_ray, "slurm": collect_slurm}[req.mode](req, session)
        rep.notes[:0] = req.notes
        return rep
    finally:
        _cleanup(req, session)
