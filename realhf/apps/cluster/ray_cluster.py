"""Start, stop and inspect a Ray cluster on a list of hosts over SSH (``scripts/ray_cluster.sh`` calls this)::

    scripts/ray_cluster.sh start  --head node01 --workers node02,node03 [--port 6379] [--num-gpus 8] \\
        [--ssh "ssh -o BatchMode=yes"] [--python /path/to/python] [--fileroot /shared/realhf]
    scripts/ray_cluster.sh status --head node01 --workers node02,node03
    scripts/ray_cluster.sh stop   --head node01 --workers node02,node03

``start`` runs ``ray start --head --port PORT`` on the head and ``ray start --address HEAD:PORT`` on every worker
(workers in parallel), waits until Ray reports one alive node per host, then runs
``python -m realhf.apps.check_cluster --mode ray`` against the cluster (GPUs per node, a shared fileroot, ports
between the nodes) on the head (``--check-on here``: on this machine); its exit code is the check's. A run then
joins with ``mode=ray ray_address=HEAD:PORT``.

``stop`` stops, on every host, the Ray processes of *this* cluster only: those whose command line names its GCS port
(``--gcs-address=...:PORT``, ``--gcs_server_port=PORT``) and their children, raylets first and the GCS last, with
SIGTERM then SIGKILL; other Ray instances on the same hosts are left alone. ``--all`` runs plain ``ray stop`` there
instead (every Ray process of the host). ``status`` prints ``ray status`` from the head and, per host, whether this
cluster's raylet runs there.

Each host runs this same file as a script (``PYTHON - --remote SPEC`` with the file on stdin), so the hosts need
only Python with Ray, and the head realhf for the check (``--python``, shell words, default: this interpreter's
path, i.e. the same environment at the same path on every node, as a shared file system or the image of
docker/Dockerfile gives; ``--python "docker exec -i realhf python"`` drives Ray inside running containers).
Ray's token auth (Ray 2.5x+: ``ray start --head`` turns it on when ``~/.ray/auth_token`` exists) is set to the
head's mode on every host (``RAY_AUTH_MODE``); each node then needs the token (a shared home, or a copy). ``--isolated`` gives every Ray
service but the GCS a free port (hosts shared with other Ray instances); a host listed twice gets it by itself.
Every SSH call has a time limit (``--timeout``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

DEFAULT_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"


# ============================================================================= run on each host (stdlib + ray/psutil)
# This part runs on hosts that may lack realhf (only Ray is required there), hence no realhf imports, and a small
# copy of realhf.base.network.find_free_ports below.
def _free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _auth_mode(spec: dict) -> str:
    """The Ray token-auth mode to use on this host: the one asked for, else what ``ray start --head`` would pick here
    (``$RAY_AUTH_MODE``, else ``token`` when a token exists: ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``). Workers and drivers must use the head's mode (Ray 2.5x+ does not pick it for them)."""
    if spec.get("auth_mode", "auto") != "auto":
        return spec["auth_mode"]
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return "token" if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path) else "disabled"


def _ray_cli(args: List[str], spec: dict) -> int:
    env = dict(os.environ, RAY_AUTH_MODE=_auth_mode(spec))
    return subprocess.call([sys.executable, "-m", "ray.scripts.scripts", *args], stdin=subprocess.DEVNULL, env=env)


def _remote_start(spec: dict) -> int:
    args = ["start", "--disable-usage-stats"]
    if spec["head"]:
        args += ["--head", f"--port={spec['port']}"]
    else:
        args += [f"--address={spec['address']}"]
    for key in ("num_cpus", "num_gpus"):
        if spec.get(key) is not None:
            args.append(f"--{key.replace('_', '-')}={spec[key]}")
    if spec.get("temp_dir"):
        args.append(f"--temp-dir={spec['temp_dir']}")
    if spec.get("isolated"):
        ports = _free_ports(3)
        args.append(f"--dashboard-agent-listen-port={ports[0]}")
        if spec["head"]:
            args += [f"--ray-client-server-port={ports[1]}", f"--dashboard-port={ports[2]}"]
    args += spec.get("extra", [])
    print(f"+ RAY_AUTH_MODE={_auth_mode(spec)} ray " + " ".join(shlex.quote(a) for a in args), flush=True)
    code = _ray_cli(args, spec)
    print(json.dumps({"auth_mode": _auth_mode(spec)}), flush=True)
    return code


def _cluster_pattern(port: int):
    return re.compile(rf"(gcs[-_]address|--address)=\S*:{port}(?!\d)|--gcs_server_port={port}(?!\d)")


def _cluster_procs(port: int) -> list:
    """This host's processes of the cluster whose GCS listens on ``port``, with their descendants."""
    import psutil

    pat, me = _cluster_pattern(port), os.getpid()
    found: Dict[int, object] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if p.pid != me and pat.search(cmd):
            found[p.pid] = p
            try:
                for c in p.children(recursive=True):
                    found.setdefault(c.pid, c)
            except psutil.Error:
                pass
    found.pop(me, None)
    return list(found.values())


def _remote_stop(spec: dict) -> int:
    import psutil

    if spec.get("all"):
        return _ray_cli(["stop"], spec)
    port, grace = spec["port"], spec.get("grace", 10)
    procs = _cluster_procs(port)

    def name(p):
        try:
            return p.name()
        except psutil.Error:
            return ""

    # raylets (with their workers) first, the GCS last, as `ray stop` does
    groups = [[p for p in procs if name(p) == "raylet"],
              [p for p in procs if name(p) not in ("raylet", "gcs_server")],
              [p for p in procs if name(p) == "gcs_server"]]
    for group in groups:
        for p in group:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(group, timeout=grace)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
    # children the raylet started while it was being stopped
    for p in _cluster_procs(port):
        try:
            p.kill()
        except psutil.Error:
            pass
    left = _cluster_procs(port)
    print(json.dumps({"stopped": len(procs), "left": [f"{p.pid}" for p in left]}), flush=True)
    return 1 if left else 0


def _remote_ps(spec: dict) -> int:
    procs = _cluster_procs(spec["port"])
    names = {}
    for p in procs:
        try:
            names[p.name()] = names.get(p.name(), 0) + 1
        except Exception:
            pass
    print(json.dumps(names), flush=True)
    return 0


def _remote_wait_nodes(spec: dict) -> int:
    """Wait until the cluster at ``address`` has ``n`` alive nodes; print the count (JSON)."""
    os.environ["RAY_AUTH_MODE"] = _auth_mode(spec)
    import ray

    ray.init(address=spec["address"], log_to_driver=False, logging_level="WARNING")
    deadline, alive = time.monotonic() + spec["timeout"], []
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= spec["n"] or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        ray.shutdown()
    print(json.dumps({"alive": len(alive), "ips": sorted(n["NodeManagerAddress"] for n in alive)}), flush=True)
    return 0 if len(alive) == spec["n"] else 1


def _remote_status(spec: dict) -> int:
    return _ray_cli(["status", f"--address={spec['address']}"], spec)


def _remote_check(spec: dict) -> int:
    """``python -m realhf.apps.check_cluster ARGS`` on this host (realhf installed, or its source tree at the path the
    caller has it: a shared file system)."""
    env = dict(os.environ, RAY_AUTH_MODE=_auth_mode(spec))
    if spec.get("source_root"):
        env["PYTHONPATH"] = spec["source_root"] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.call([sys.executable, "-m", "realhf.apps.check_cluster", *spec["args"]], env=env,
                           stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def remote_main(spec: dict) -> int:
    return {"start": _remote_start, "stop": _remote_stop, "ps": _remote_ps, "wait_nodes": _remote_wait_nodes,
            "status": _remote_status, "check": _remote_check}[spec["action"]](spec)


# ============================================================================= the local side
class HostError(RuntimeError):
    pass


class Cluster:
    def __init__(self, a):
        self.head = a.head
        self.workers = [h.strip() for h in (a.workers or "").split(",") if h.strip()]
        self.port = a.port
        self.ssh = shlex.split(a.ssh)
        self.python = a.python
        self.timeout = a.timeout
        self.address = f"{self.head}:{self.port}"
        self.auth_mode = a.auth_mode

    @property
    def hosts(self) -> List[str]:
        return [self.head] + self.workers

    def remote(self, host: str, spec: dict, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        """Run this file on ``host`` over SSH with ``spec``; raises HostError when SSH fails or times out."""
        with open(os.path.abspath(__file__)) as f:
            source = f.read()
        remote_cmd = " ".join(shlex.quote(x) for x in [*shlex.split(self.python), "-", "--remote", json.dumps(spec)])
        cmd = self.ssh + [host, remote_cmd]
        try:
            p = subprocess.run(cmd, input=source, capture_output=True, text=True, timeout=timeout or self.timeout,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            raise HostError(f"{host}: no answer over SSH within {timeout or self.timeout:g} s "
                            f"({' '.join(self.ssh)} {host} ...)") from None
        if p.returncode == 255:  # ssh's own failure
            raise HostError(f"{host}: ssh failed: {p.stderr.strip()[-500:]}")
        return p


def _last_json(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (what a remote action printed last), or {}."""
    for line in reversed(text.strip().splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return {}


def _tail(text: str, n: int = 15) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join("    " + line for line in lines[-n:])


def _parallel(fn, items):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(items)))) as ex:
        return list(ex.map(fn, items))


def cmd_start(a) -> int:
    c = Cluster(a)
    base = dict(action="start", num_cpus=a.num_cpus, num_gpus=a.num_gpus, temp_dir=a.temp_dir,
                isolated=a.isolated, auth_mode=a.auth_mode)
    print(f"starting the Ray head on {c.head} (port {c.port})", flush=True)
    p = c.remote(c.head, dict(base, head=True, port=c.port, extra=shlex.split(a.head_args)))
    if p.returncode != 0:
        print(f"error: ray start --head failed on {c.head} (exit {p.returncode}):\n{_tail(p.stdout + p.stderr)}")
        return 1
    base["auth_mode"] = c.auth_mode = _last_json(p.stdout).get("auth_mode", a.auth_mode)  # the head's, everywhere
    seen = {c.head: 1}
    specs = []
    for h in c.workers:  # a host named twice (or the head again) gets ports of its own
        specs.append((h, dict(base, head=False, address=c.address, extra=shlex.split(a.worker_args),
                              isolated=a.isolated or h in seen)))
        seen[h] = seen.get(h, 0) + 1

    def start_worker(item):
        host, spec = item
        try:
            return host, c.remote(host, spec), None
        except HostError as e:
            return host, None, str(e)

    failed = []
    if specs:
        print(f"starting {len(specs)} Ray worker(s): {', '.join(c.workers)}", flush=True)
    for host, p, err in _parallel(start_worker, specs):
        if err or p.returncode != 0:
            failed.append(host)
            print(f"error: ray start on {host} failed: {err or _tail(p.stdout + p.stderr)}")
    if failed:
        print(f"{len(failed)} worker(s) did not start; `stop` with the same hosts stops the ones that did.")
        return 1
    n = len(c.hosts)
    p = c.remote(c.head, dict(action="wait_nodes", address=c.address, n=n, timeout=a.nodes_timeout,
                              auth_mode=c.auth_mode), timeout=a.nodes_timeout + a.timeout)
    got = _last_json(p.stdout)
    if "alive" not in got:
        print(f"error: cannot count the cluster's nodes from {c.head}:\n{_tail(p.stdout + p.stderr)}")
        return 1
    if got["alive"] != n:
        print(f"error: Ray reports {got['alive']} alive node(s) ({', '.join(got['ips'])}) but {n} host(s) were "
              f"started ({', '.join(c.hosts)}): see the Ray logs of the missing hosts (<temp dir>/session_latest/logs).")
        return 1
    print(f"Ray cluster up: {n} node(s) at {c.address} ({', '.join(got['ips'])})", flush=True)
    if a.no_check:
        return 0
    args = ["--mode", "ray", "--ray-address", c.address, "--nodes", str(n), "--timeout", f"{a.check_timeout:g}"]
    if a.num_gpus:
        args += ["--gpus-per-node", str(a.num_gpus)]
    if a.fileroot:
        args += ["--fileroot", a.fileroot]
    where = c.head if a.check_on == "head" else "here"
    print(f"checking it ({where}): RAY_AUTH_MODE={c.auth_mode} python -m realhf.apps.check_cluster "
          + " ".join(shlex.quote(x) for x in args), flush=True)
    if a.check_on == "head":
        from realhf.base.process import source_root

        p = c.remote(c.head, dict(action="check", args=args, auth_mode=c.auth_mode, source_root=source_root()),
                     timeout=a.check_timeout + a.timeout + 60)
        print((p.stdout + p.stderr).rstrip(), flush=True)
        code = p.returncode
    else:
        code = subprocess.call([sys.executable, "-m", "realhf.apps.check_cluster", *args], stdin=subprocess.DEVNULL,
                               env=dict(os.environ, RAY_AUTH_MODE=c.auth_mode))
    if code == 0:
        env = "RAY_AUTH_MODE=token " if c.auth_mode == "token" else ""
        print(f"ready: run with {env}python -m realhf.apps.quickstart ... mode=ray ray_address={c.address} n_nodes={n}")
    return code


def cmd_stop(a) -> int:
    c = Cluster(a)
    spec = dict(action="stop", port=c.port, all=a.all, grace=a.grace, auth_mode=a.auth_mode)
    hosts = list(dict.fromkeys(c.workers[::-1] + [c.head]))  # workers first, the head (GCS) last; each host once

    def stop(host):
        try:
            return host, c.remote(host, spec, timeout=a.timeout + 3 * a.grace), None
        except HostError as e:
            return host, None, str(e)

    code = 0
    for host, p, err in [stop(h) for h in hosts]:
        if err:
            print(f"error: {err}")
            code = 1
        elif p.returncode != 0:
            print(f"error: stopping Ray on {host} failed:\n{_tail(p.stdout + p.stderr)}")
            code = 1
        elif a.all:
            print(f"{host}: ray stop done")
        else:
            print(f"{host}: stopped {_last_json(p.stdout).get('stopped', '?')} Ray process(es) of the cluster on port "
                  f"{c.port}")
    return code


def cmd_status(a) -> int:
    c = Cluster(a)
    code = 0
    for host in dict.fromkeys(c.hosts):
        try:
            p = c.remote(host, dict(action="ps", port=c.port))
            names = _last_json(p.stdout) if p.returncode == 0 else {}
            state = (f"raylet running ({sum(names.values())} process(es) of this cluster)" if names.get("raylet")
                     else "no raylet of this cluster")
        except HostError as e:
            state, code = f"unknown ({e})", 1
        print(f"{host}: {state}")
    try:
        p = c.remote(c.head, dict(action="status", address=c.address, auth_mode=a.auth_mode))
        print(p.stdout.rstrip())
        if p.returncode != 0:
            print(f"error: ray status on {c.head} failed:\n{_tail(p.stderr)}")
            code = 1
    except HostError as e:
        print(f"error: {e}")
        code = 1
    return code


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="scripts/ray_cluster.sh", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start, stop and inspect a Ray cluster on a list of hosts over SSH.",
        epilog="start: `ray start --head` on --head, `ray start --address HEAD:PORT` on each worker, a wait until Ray\n"
               "reports one node per host, then `python -m realhf.apps.check_cluster --mode ray` (its exit code).\n"
               "stop: stops this cluster's Ray processes (those of its GCS port) on every host; --all: `ray stop`.\n"
               "status: `ray status` from the head, and whether this cluster's raylet runs on each host.\n"
               "example: scripts/ray_cluster.sh start --head node01 --workers node02,node03 --num-gpus 8 \\\n"
               "             --fileroot /shared/realhf")
    ap.add_argument("command", choices=["start", "stop", "status"])
    ap.add_argument("--head", required=True, help="host of the Ray head (as SSH reaches it; workers join HEAD:PORT)")
    ap.add_argument("--workers", default="", help="comma-separated worker hosts (none: a one-node cluster)")
    ap.add_argument("--port", type=int, default=6379, help="the head's GCS port (default 6379)")
    ap.add_argument("--ssh", default=DEFAULT_SSH, help=f"the SSH command, split as shell words (default {DEFAULT_SSH!r})")
    ap.add_argument("--python", default=sys.executable,
                    help="Python with Ray (and realhf) on every host, as shell words (default: this interpreter's "
                         "path); e.g. 'docker exec -i realhf python' for Ray inside a running container")
    ap.add_argument("--num-gpus", type=int, help="GPUs Ray offers on each node (default: Ray detects them)")
    ap.add_argument("--num-cpus", type=int, help="CPUs Ray offers on each node (default: Ray detects them)")
    ap.add_argument("--temp-dir", help="Ray's temp dir on every host (default /tmp/ray; keep it short: socket paths "
                                       "below it must fit 107 bytes)")
    ap.add_argument("--isolated", action="store_true",
                    help="free ports for every Ray service but the GCS (hosts shared with other Ray instances)")
    ap.add_argument("--auth-mode", choices=["auto", "token", "disabled"], default="auto",
                    help="Ray token auth (RAY_AUTH_MODE) on every host; auto: the head's choice (token when "
                         "~/.ray/auth_token exists there), passed to the workers (each needs the token then)")
    ap.add_argument("--head-args", default="", help="extra `ray start --head` flags, as shell words")
    ap.add_argument("--worker-args", default="", help="extra `ray start` flags of the workers, as shell words")
    ap.add_argument("--fileroot", help="start: the run's fileroot, checked as shared by every node (check_cluster)")
    ap.add_argument("--no-check", action="store_true", help="start: skip check_cluster")
    ap.add_argument("--check-on", choices=["head", "here"], default="head",
                    help="start: run check_cluster on the head over SSH (default) or on this machine")
    ap.add_argument("--timeout", type=float, default=120, help="seconds one SSH call may take (default 120)")
    ap.add_argument("--nodes-timeout", type=float, default=60,
                    help="start: seconds to wait until every node has joined (default 60)")
    ap.add_argument("--check-timeout", type=float, default=60, help="start: check_cluster's --timeout (default 60)")
    ap.add_argument("--all", action="store_true", help="stop: plain `ray stop` on every host (all its Ray processes)")
    ap.add_argument("--grace", type=float, default=10, help="stop: seconds between SIGTERM and SIGKILL (default 10)")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--remote"]:
        return remote_main(json.loads(argv[1]))
    a = _parser().parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    try:
        return {"start": cmd_start, "stop": cmd_stop, "status": cmd_status}[a.command](a)
    except HostError as e:
        print(f"error: {e}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
