"""One node's side of ``check_cluster``: what the node reports (hostname, ``REALHF_HOST`` address, CPUs, GPUs, memory,
versions) and the probe that checks, through ``<fileroot>/.check_cluster/<session>/``, that ``fileroot`` is writable
and shared with every other node and that every node's TCP port is reachable.

``probe`` runs in the ``check_cluster`` process (local mode), as a Ray task (``_ray_probe``, pickled by reference to
this module) or as the ``--probe`` command of a Slurm step; it returns a dict the report is built from.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, Optional

from realhf.base import network

PROBE_TAG = "REALHF_CHECK_CLUSTER_PROBE "  # prefixes the JSON line a Slurm probe step prints
SESSION_DIR = ".check_cluster"


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

