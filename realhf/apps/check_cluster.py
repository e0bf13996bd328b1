"""``python -m realhf.apps.check_cluster``: what a run will see on its nodes, checked before a long job is submitted.

Two ways to call it::

    python -m realhf.apps.check_cluster --mode slurm --nodes 4 --gpus-per-node 8 --fileroot /shared/realhf \\
        --partition gpu --account myproj
    python -m realhf.apps.check_cluster --config x.yaml --exp ppo-math [key=value ...]   # the run's own options

One probe runs on every node the run would use (``local``: in this process; ``ray``: one task per alive node of the
cluster at ``--ray-address``, pinned with ``NodeAffinitySchedulingStrategy``; ``slurm``: one
``srun --nodes=N --ntasks-per-node=1`` step running this module with ``--probe``). Each probe reports its node
(hostname, the IP a run's processes bind there, i.e. ``REALHF_HOST``, CPUs, GPUs, free memory, python/torch/realhf
versions) and checks, through ``<fileroot>/.check_cluster/<session>/``:

* that ``fileroot`` is writable there (it holds logs, checkpoints and the name-resolve directory the processes of a
  run find each other through);
* that it is shared: each node writes a token file and reads back every node's token;
* that ports are reachable: each node listens on a TCP port of its IP, publishes ``host:port`` in the shared folder,
  and connects to every node's port (the listener answers with its node's token, so a wrong process cannot pass).

The table ends with a verdict: exit 0 when the run's needs are met (enough nodes, GPUs per node, shared fileroot,
ports), exit 1 with one sentence per problem saying what to fix. ``--json`` prints the report as JSON instead.
Every wait is bounded (``--timeout`` for the probes, ``--alloc-timeout`` for Slurm to start the step, a connect
timeout for Ray), so an unreachable cluster ends with a message, never a hang.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional

from realhf.base import network
from realhf.scheduler.slurm import sinfo, srun_step_args

PROBE_TAG = "REALHF_CHECK_CLUSTER_PROBE "
SESSION_DIR = ".check_cluster"
MODES = ("local", "ray", "slurm")


# ----------------------------------------------------------------------------- what one node reports
def _gpus() -> tuple:
    """(count, names, source): torch's CUDA devices when torch sees CUDA, else nvidia-smi's list, else none."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return n, [torch.cuda.get_device_name(i) for i in range(n)], "torch"
    except Exception:  # a broken CUDA install must not end the probe
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30)
            if p.returncode == 0:
                names = [line.strip() for line in p.stdout.splitlines() if line.strip()]
                return len(names), names, "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return 0, [], "none"


def _memory_gib() -> tuple:
    """(available, total) memory of this node in GiB (``/proc/meminfo``), or (None, None)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if len(line.split()) >= 2}
        return round(kb["MemAvailable"] / 2**20, 1), round(kb["MemTotal"] / 2**20, 1)
    except (OSError, KeyError, ValueError):
        return None, None


def _versions() -> Dict[str, Optional[str]]:
    v: Dict[str, Optional[str]] = {"python": platform.python_version(), "torch": None, "realhf": None}
    try:
        import torch

        v["torch"] = torch.__version__
    except Exception:
        pass
    try:
        from importlib import metadata

        v["realhf"] = metadata.version("realhf")
    except Exception:
        v["realhf"] = "source" if "realhf" in sys.modules else None
    if "ray" in sys.modules:
        v["ray"] = getattr(sys.modules["ray"], "__version__", None)
    return v


def node_info() -> dict:
    """Hostname, CPUs, GPUs, memory and versions of this node."""
    n_gpus, names, source = _gpus()
    avail, total = _memory_gib()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return dict(hostname=socket.gethostname(), cpus=os.cpu_count(), cpus_usable=usable, gpus=n_gpus,
                gpu_names=names, gpu_source=source, mem_free_gib=avail, mem_total_gib=total, **_versions())


def host_address(host_cmd: str = "") -> str:
    """The address a run's processes bind on this node: ``$REALHF_HOST`` when set, else the output of ``host_cmd``
    (a shell command, as the Slurm launcher's ``slurm.host_cmd``), else this node's outward IP."""
    if os.environ.get("REALHF_HOST"):
        return os.environ["REALHF_HOST"]
    if host_cmd:
        try:
            p = subprocess.run(host_cmd, shell=True, capture_output=True, text=True, timeout=15)
            out = p.stdout.strip().split()
            if p.returncode == 0 and out:
                return out[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return network.gethostip()


# ----------------------------------------------------------------------------- the probe (runs on every node)
class _Listener:
    """A TCP listener on ``host`` that answers every connection with ``token``."""

    def __init__(self, host: str, token: str):
        self.token = token
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="check-cluster-listener")
        self.thread.start()

    def _serve(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    conn.recv(256)
                    conn.sendall((self.token + "\n").encode())
                except OSError:
                    pass

    def close(self):
        self.closed.set()
        self.thread.join(timeout=2)
        self.sock.close()


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # readers see a whole file or none


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None


def _ask_token(host: str, port: int, timeout: float = 5.0) -> str:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(b"check_cluster\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


def session_dir(fileroot: str, session: str) -> str:
    return os.path.join(os.path.expanduser(fileroot), SESSION_DIR, session)


def probe(fileroot: str, session: str, index: int, n_nodes: int, timeout: float = 60.0, host: Optional[str] = None,
          host_cmd: str = "") -> dict:
    """Run on node ``index`` of ``n_nodes``: publish this node's token and listening address under ``fileroot``,
    then read every node's token and connect to every node's port, for at most ``timeout`` seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    host = host or host_address(host_cmd)
    token = uuid.uuid4().hex
    root = os.path.expanduser(fileroot)
    d = session_dir(fileroot, session)
    out: dict = dict(index=index, ip=host, fileroot=root, fileroot_ok=False, fileroot_error=None, listen=None,
                     listen_error=None, shared={}, ports={})
    listener = None
    try:
        listener = _Listener(host, token)
        out["listen"] = f"{host}:{listener.port}"
    except OSError as e:
        out["listen_error"] = f"cannot listen on {host}: {e}"
    try:
        os.makedirs(d, exist_ok=True)
        _write_json(os.path.join(d, f"node-{index}.json"),
                    dict(index=index, token=token, hostname=socket.gethostname(), host=host,
                         port=listener.port if listener else None))
        out["fileroot_ok"] = True
    except OSError as e:
        out["fileroot_error"] = f"{type(e).__name__}: {e}"
    out.update(node_info())  # after publishing: a slow torch import on one node does not hold the others back
    try:
        pending = set(range(n_nodes))
        if not out["fileroot_ok"]:
            pending.discard(index)
            out["shared"][str(index)] = "this node could not write its token"
            out["ports"][str(index)] = "not checked (no address published)"
        while pending:
            for j in sorted(pending):
                peer = _read_json(os.path.join(d, f"node-{j}.json"))
                if peer is None:
                    continue
                pending.discard(j)
                out["shared"][str(j)] = "ok" if peer.get("token") else "token file is empty"
                if not peer.get("port"):
                    out["ports"][str(j)] = "not checked (that node could not listen)"
                    continue
                try:
                    answer = _ask_token(peer["host"], int(peer["port"]))
                    out["ports"][str(j)] = ("ok" if answer == peer["token"] else
                                            f"{peer['host']}:{peer['port']} answered, but not node {j}'s probe")
                except OSError as e:
                    out["ports"][str(j)] = f"cannot connect to {peer['host']}:{peer['port']}: {e}"
            if pending:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        for j in pending:
            out["shared"][str(j)] = f"no token from node {j} after {timeout:g} s"
            out["ports"][str(j)] = "not checked (no address published)"
        if out["fileroot_ok"]:  # keep listening until every node is done connecting (or the time is up)
            try:
                open(os.path.join(d, f"done-{index}"), "w").close()
            except OSError:
                pass
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join(d, f"done-{j}")) for j in range(n_nodes)):
                time.sleep(0.1)
    finally:
        if listener is not None:
            listener.close()
    out["elapsed_s"] = round(time.monotonic() - t0, 2)
    return out


def _ray_probe(fileroot: str, session: str, index: int, n_nodes: int, timeout: float) -> dict:
    """The probe as a Ray task: the node's address is the one the Ray launcher gives its jobs as ``REALHF_HOST``."""
    import ray

    return probe(fileroot, session, index, n_nodes, timeout, host=ray.util.get_node_ip_address())


# ----------------------------------------------------------------------------- what the run needs
@dataclasses.dataclass
class Request:
    mode: str = "local"
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: 0 unless the config asks for GPUs (see needed_gpus)
    fileroot: str = ""
    ray_address: str = ""
    partition: str = ""
    account: str = ""
    host_cmd: str = ""
    srun_args: List[str] = dataclasses.field(default_factory=list)
    devices_per_node: Optional[int] = None  # from a config: n_devices_per_node (GPUs, or worker processes on CPU)
    timeout: float = 60.0
    alloc_timeout: float = 60.0
    connect_timeout: float = 30.0
    notes: List[str] = dataclasses.field(default_factory=list)  # about the request itself (how it was read)


@dataclasses.dataclass
class Report:
    request: Request
    nodes: List[dict] = dataclasses.field(default_factory=list)
    errors: List[str] = dataclasses.field(default_factory=list)  # the cluster could not be probed (whole sentences)
    notes: List[str] = dataclasses.field(default_factory=list)
    problems: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)
    stuck: bool = False  # a client call (ray.init) is still blocked in a thread: the CLI exits with os._exit

    @property
    def ok(self) -> bool:
        return not self.errors and not self.problems

    def to_json(self) -> dict:
        return dict(ok=self.ok, request=dataclasses.asdict(self.request), nodes=self.nodes, errors=self.errors,
                    problems=self.problems, warnings=self.warnings, notes=self.notes)


def request_from_config(exp: str, config_file: str, overrides: List[str]) -> Request:
    """The run's options (mode, n_nodes, n_devices_per_node, fileroot, ray_address, the slurm section) as a request;
    GPUs per node are required where the config reserves them (``ray_gpus_per_worker``, ``slurm.gpus_per_slot``).

    A config that does not validate on this machine (e.g. model paths that exist only on the cluster) is still read
    for these options, with a note saying why the run would be refused here."""
    from omegaconf import OmegaConf

    from realhf.api.quickstart.entry import ConfigError, load_config
    from realhf.experiments import config_class

    cls, note = config_class(exp), None
    try:
        cfg = load_config(cls, [config_file], overrides)
    except ConfigError as e:
        try:  # the same sources, merged without the experiment's checks
            cfg = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.load(config_file),
                                  OmegaConf.from_dotlist(list(overrides)))
        except Exception:
            raise e from None
        note = (f"the config does not validate on this machine ({e}); its cluster options were read anyway "
                "(a run launched from here would be refused).")
    req = _request_from(cfg)
    if note:
        req.notes.append(note)
    return req


def _request_from(cfg) -> Request:
    req = Request(mode=cfg.mode, nodes=cfg.n_nodes, fileroot=cfg.fileroot, ray_address=cfg.ray_address,
                  devices_per_node=cfg.n_devices_per_node)
    slurm = getattr(cfg, "slurm", None)
    if slurm is not None:
        req.partition = getattr(slurm, "partition", "") or ""
        req.account = getattr(slurm, "account", "") or ""
        req.host_cmd = getattr(slurm, "host_cmd", "") or ""
        req.srun_args = srun_step_args(cfg)
    if cfg.mode == "ray" and cfg.ray_gpus_per_worker > 0:
        req.gpus_per_node = math.ceil(cfg.n_devices_per_node * cfg.ray_gpus_per_worker - 1e-9)
    elif cfg.mode == "slurm" and slurm is not None and getattr(slurm, "gpus_per_slot", 0) > 0:
        req.gpus_per_node = cfg.n_devices_per_node * slurm.gpus_per_slot
    return req


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
    from realhf.apps import check_cluster as this  # the probe is pickled by reference, also under `python -m`
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
        remote = ray.remote(num_cpus=0, max_retries=0)(this._ray_probe)
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


# ----------------------------------------------------------------------------- verdict
def judge(rep: Report) -> Report:
    """Fill ``rep.problems`` (each a sentence saying what to fix) and ``rep.warnings``."""
    req, nodes = rep.request, [n for n in rep.nodes if not n.get("failed")]
    probs, warns = rep.problems, rep.warnings
    if not nodes and not rep.errors:
        rep.errors.append("no node answered the probe.")
    if nodes and len(rep.nodes) < req.nodes:
        if req.mode == "local" or (req.mode == "ray" and not req.ray_address):
            what = ("mode=local runs every process on this machine" if req.mode == "local" else
                    "ray_address is empty, so the run starts a one-node Ray on this machine")
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but {what}: use mode=slurm, or mode=ray with "
                         "ray_address=<head>:<port> of a cluster (scripts/ray_cluster.sh start), or set n_nodes=1.")
        elif req.mode == "ray":
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but the Ray cluster at {req.ray_address} has "
                         f"{len(rep.nodes)} alive: add workers (scripts/ray_cluster.sh start --workers ...) or lower "
                         "n_nodes.")
        else:
            probs.append(f"the run needs {req.nodes} nodes (n_nodes) but only {len(rep.nodes)} answered the probe: "
                         "see the srun output above and the nodes' health (sinfo -N).")
    need = req.gpus_per_node or 0
    any_gpu = any(n.get("gpus", 0) for n in nodes)
    if req.gpus_per_node is None and any_gpu and req.devices_per_node:
        need = req.devices_per_node  # a GPU run: one model worker per GPU
    for n in nodes:
        where = f"node {n['index']} ({n.get('hostname')}, {n.get('ip')})"
        if n.get("gpus", 0) < need:
            probs.append(f"{where} has {n.get('gpus', 0)} GPU(s) but the run needs {need} per node: use nodes with "
                         f"{need} GPU(s) (check the driver with nvidia-smi) or lower n_devices_per_node.")
        elif "ray_gpus" in n and n["ray_gpus"] < need:
            probs.append(f"Ray on {where} offers {n['ray_gpus']:g} GPU(s) but the run needs {need}: restart that "
                         f"node's Ray with --num-gpus={need} (scripts/ray_cluster.sh start --num-gpus {need}).")
        if not n.get("fileroot_ok"):
            probs.append(f"fileroot={req.fileroot!r} is not writable on {where} ({n.get('fileroot_error')}): choose a "
                         "folder every node can write (fileroot=... or $REALHF_FILEROOT).")
        if n.get("listen_error"):
            probs.append(f"{where} cannot open a TCP port: {n['listen_error']}; set REALHF_HOST to an address of "
                         "this node.")
    by_index = {n["index"]: n for n in nodes}
    for n in nodes:
        if not n.get("fileroot_ok"):
            continue
        where = f"node {n['index']} ({n.get('hostname')})"
        for j, status in sorted(n.get("shared", {}).items(), key=lambda kv: int(kv[0])):
            other = by_index.get(int(j))
            if status != "ok" and other is not None and other.get("fileroot_ok"):
                probs.append(f"a file written under fileroot on node {j} is not visible on {where} ({status}): "
                             "fileroot must be one shared file system (NFS, Lustre, ...) mounted at the same path on "
                             "every node.")
        for j, status in sorted(n.get("ports", {}).items(), key=lambda kv: int(kv[0])):
            if status == "ok" or status.startswith("not checked"):
                continue
            other = by_index.get(int(j), {})
            hint = (f" (node {j} published a loopback address: set REALHF_HOST to its network IP)"
                    if other.get("ip") and network.is_loopback(other["ip"]) and len(nodes) > 1 else "")
            probs.append(f"{where} cannot reach node {j}'s port: {status}{hint}: open TCP ports between the nodes "
                         "(firewall, security groups) or bind another interface (REALHF_HOST).")
    if nodes and not any_gpu and not req.gpus_per_node and req.devices_per_node:
        rep.notes.append(f"no GPU on any node: the run uses CPU worker processes ({req.devices_per_node} per node); "
                         "pass --gpus-per-node G to require GPUs.")
    for key in ("python", "torch", "realhf"):
        seen = {}
        for n in nodes:
            seen.setdefault(str(n.get(key)), []).append(str(n["index"]))
        if len(seen) > 1:
            detail = "; ".join(f"{v} on node(s) {','.join(ix)}" for v, ix in seen.items())
            warns.append(f"{key} differs across nodes ({detail}): install one environment everywhere (e.g. the image "
                         "of docker/Dockerfile).")
    return rep


# ----------------------------------------------------------------------------- output
def _cell(v) -> str:
    return "-" if v is None else str(v)


def format_report(rep: Report) -> str:
    req = rep.request
    lines = [f"check_cluster: mode={req.mode} nodes={req.nodes} gpus/node={req.gpus_per_node or 0} "
             f"fileroot={req.fileroot}" + (f" ray_address={req.ray_address}" if req.mode == "ray" else "")
             + (f" partition={req.partition}" if req.partition else "") + (f" account={req.account}" if req.account
                                                                            else "")]
    header = ["node", "hostname", "ip (REALHF_HOST)", "cpus", "gpus", "mem free GiB", "python", "torch", "realhf",
              "fileroot", "shared dir", "ports"]
    diff = {k for k in ("python", "torch", "realhf") if len({str(n.get(k)) for n in rep.nodes if not n.get("failed")}) > 1}
    rows = []
    for n in rep.nodes:
        if n.get("failed"):
            rows.append([str(n.get("index")), _cell(n.get("hostname")), _cell(n.get("ip"))] + ["?"] * 6 +
                        ["no answer", "-", "-"])
            continue
        total = len(n.get("shared", {})) or 1
        shared_ok = sum(v == "ok" for v in n.get("shared", {}).values())
        ports_ok = sum(v == "ok" for v in n.get("ports", {}).values())
        gpus = str(n.get("gpus", 0)) + (f" (ray {n['ray_gpus']:g})" if "ray_gpus" in n else "")
        cpus = str(n.get("cpus")) + (f" (ray {n['ray_cpus']:g})" if "ray_cpus" in n else "")
        rows.append([str(n["index"]), _cell(n.get("hostname")), _cell(n.get("ip")), cpus, gpus,
                     f"{_cell(n.get('mem_free_gib'))}/{_cell(n.get('mem_total_gib'))}"]
                    + [_cell(n.get(k)) + (" *" if k in diff else "") for k in ("python", "torch", "realhf")]
                    + ["writable" if n.get("fileroot_ok") else "NOT writable", f"{shared_ok}/{total} ok",
                       f"{ports_ok}/{total} ok"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows if rows else []:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not rows:
        lines.append("(no node answered)")
    for n in rep.nodes:
        if n.get("gpu_names"):
            lines.append(f"node {n['index']} GPUs ({n.get('gpu_source')}): {', '.join(n['gpu_names'])}")
    if diff:
        lines.append("* differs across nodes")
    for note in rep.notes:
        lines.append(f"note: {note}")
    for w in rep.warnings:
        lines.append(f"warning: {w}")
    issues = rep.errors + rep.problems
    if issues:
        lines.append(f"NOT READY: {len(issues)} problem(s)")
        lines += [f"  - {p}" for p in issues]
    else:
        n_nodes = len(rep.nodes)
        lines.append(f"READY: {n_nodes} node(s) answered; fileroot is writable and shared, ports are reachable"
                     + (f", {req.gpus_per_node} GPU(s) per node" if req.gpus_per_node else "") + ".")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m realhf.apps.check_cluster",
                                 description="Check what a run will see on its nodes (nodes, CPUs, GPUs, a shared "
                                             "writable fileroot, reachable ports) before submitting it.")
    ap.add_argument("--mode", choices=MODES, help="launcher to check (default: the config's, else local)")
    ap.add_argument("--nodes", type=int, help="nodes the run needs (n_nodes)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs each node must have (default 0, or from the config)")
    ap.add_argument("--fileroot", help="the run's fileroot (must be shared by every node)")
    ap.add_argument("--ray-address", help="mode=ray: host:port of the Ray head (or 'auto')")
    ap.add_argument("--partition", help="mode=slurm: partition (srun --partition)")
    ap.add_argument("--account", help="mode=slurm: account (srun --account)")
    ap.add_argument("--config", help="take the options from this experiment config (with --exp and key=value ...)")
    ap.add_argument("--exp", help="the experiment of --config, e.g. ppo-math")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds the probes wait for each other (default 60)")
    ap.add_argument("--alloc-timeout", type=float, default=60.0,
                    help="mode=slurm: seconds Slurm may take to start the probe step (srun --immediate; default 60)")
    ap.add_argument("--connect-timeout", type=float, default=30.0,
                    help="mode=ray: seconds to join the cluster (default 30)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    # internal: one node's probe (run by the srun step)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--session", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--host-cmd", default="", help=argparse.SUPPRESS)
    return ap


def build_request(a) -> Request:
    if a.config:
        if not a.exp:
            raise ValueError("--config needs --exp <experiment>, e.g. --exp ppo-math")
        req = request_from_config(a.exp, a.config, a.overrides)
    else:
        if a.overrides:
            raise ValueError(f"key=value overrides ({' '.join(a.overrides)}) need --config x.yaml --exp <experiment>")
        if a.exp:
            raise ValueError("--exp needs --config x.yaml")
        from realhf.api.quickstart.config import _default_fileroot

        req = Request(fileroot=_default_fileroot())
    for key in ("mode", "nodes", "gpus_per_node", "fileroot", "ray_address", "partition", "account"):
        if getattr(a, key) is not None:
            setattr(req, key, getattr(a, key))
    req.timeout, req.alloc_timeout, req.connect_timeout = a.timeout, a.alloc_timeout, a.connect_timeout
    if req.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {req.nodes}")
    if req.gpus_per_node is not None and req.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {req.gpus_per_node}")
    return req


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_intermixed_args(argv)
    if a.probe:
        if not a.fileroot or not a.session:
            ap.error("--probe needs --fileroot and --session")
        index = a.index if a.index is not None else int(os.environ.get("SLURM_PROCID", "0"))
        result = probe(a.fileroot, a.session, index, a.expect, a.timeout, host_cmd=a.host_cmd)
        sys.stdout.write(PROBE_TAG + json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0
    try:
        req = build_request(a)
    except Exception as e:  # config errors, unknown experiments: a message, exit 2 as quickstart does
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.stderr.write(f"error: {msg}\n")
        return 2
    rep = judge(collect(req))
    if a.json:
        sys.stdout.write(json.dumps(rep.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_report(rep) + "\n")
    sys.stdout.flush()
    code = 0 if rep.ok else 1
    if rep.stuck:  # a blocked client call (ray.init) would hold the interpreter's exit
        sys.stderr.flush()
        os._exit(code)
    return code


def _watchdog(seconds: float) -> None:
    """End the command with a message if it is still running after ``seconds`` (a last guard against hangs)."""

    def fire():
        sys.stderr.write(f"check_cluster: no result after {seconds:g} s; giving up (a cluster call did not return)\n")
        sys.stderr.flush()
        os._exit(1)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


if __name__ == "__main__":
    _args, _ = _parser().parse_known_intermixed_args()
    _watchdog(_args.timeout + _args.alloc_timeout + _args.connect_timeout + 120)
    sys.exit(main())
