"""A real one-node Slurm for the tests: munged, slurmctld and slurmd from the Debian packages, every file (keys,
sockets, state, spool, logs) in one private directory, ports picked free, stopped by PID afterwards.

``start_slurm(root)`` installs the packages when they are missing (root + apt-get; otherwise the caller skips with
the reason), writes ``slurm.conf`` (one node named after this host at 127.0.0.1; ``cpus`` CPUs declared through
``SlurmdParameters=config_overrides``, so a run's tasks fit a 2-core machine; ``gpus`` fake GPUs as GRES over
character devices, so ``--gpus-per-task`` is accepted as on a GPU cluster), starts the daemons and waits until the
node is idle. The returned :class:`Slurm` holds the client environment (``SLURM_CONF``) and ``stop()``s the daemons.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


class SlurmUnavailable(RuntimeError):
    """The packages are missing and cannot be installed here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_packages(timeout: float = 600.0) -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld/slurmd/munge are not installed and cannot be (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {(p.stderr or p.stdout)[-800:]}")


class Slurm:
    def __init__(self, root: str, cpus: int = 16, gpus: int = 2):
        self.root = os.path.abspath(root)
        self.cpus, self.gpus = cpus, gpus
        self.node = socket.gethostname().split(".")[0]
        self.procs: Dict[str, subprocess.Popen] = {}
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {"SLURM_CONF": self.conf}

    def _path(self, *p: str) -> str:
        return os.path.join(self.root, *p)

    def _write_config(self):
        for d in ("munge", "state", "spool", "log", "dev"):
            os.makedirs(self._path(d), exist_ok=True)
        os.chmod(self._path("munge"), 0o700)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        os.makedirs(self._path("munge-socket"), exist_ok=True)
        os.chmod(self._path("munge-socket"), 0o755)  # else munge says "Socket is inaccessible"
        self.munge_socket = self._path("munge-socket", "munge.sock")
        gres_line, gres_files = "", []
        for i in range(self.gpus):  # fake GPU devices: character devices (like /dev/null) Slurm can hand out
            dev = self._path("dev", f"fakegpu{i}")
            if not os.path.exists(dev):
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
            gres_files.append(dev)
        if gres_files:
            gres_line = f" Gres=gpu:{len(gres_files)}"
            with open(self._path("gres.conf"), "w") as f:
                for dev in gres_files:
                    f.write(f"NodeName={self.node} Name=gpu File={dev}\n")
        ctld_port, slurmd_port = _free_port(), _free_port()
        lines = [
            "ClusterName=realhftest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd.pid')}",
            f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self._path('log', 'slurmd.log')}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",
            "KillWait=5",  # SIGTERM to SIGKILL when Slurm ends a job (time limit, scancel)
            "OverTimeLimit=0",  # a job is ended at the first time-limit check after its end time (every 30 s)
            "InactiveLimit=0",
            "GresTypes=gpu" if gres_files else "",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN{gres_line}",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(x for x in lines if x) + "\n")
        with open(self._path("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=autodetect\n")

    def _start(self, name: str, cmd: List[str]):
        log = open(self._path("log", f"{name}.out"), "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, **self.env), start_new_session=True)

    def start(self, timeout: float = 60.0) -> "Slurm":
        self._write_config()
        self._start("munged", ["munged", "-F", "--force", f"--key-file={self._path('munge', 'munge.key')}",
                               f"--socket={self.munge_socket}", f"--pid-file={self._path('munge', 'munged.pid')}",
                               f"--log-file={self._path('log', 'munged.log')}",
                               f"--seed-file={self._path('munge', 'munged.seed')}"])
        t0 = time.monotonic()
        while not os.path.exists(self.munge_socket):
            self._check_alive("munged")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"munged did not open its socket; log: {self.log_tail('munged')}")
            time.sleep(0.05)
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._start("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", self.node])
        while True:
            for n in ("slurmctld", "slurmd"):
                self._check_alive(n)
            p = self.run(["sinfo", "-h", "-o", "%T"], timeout=15, check=False)
            if p.returncode == 0 and p.stdout.strip() == "idle":
                return self
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the Slurm node did not become idle (sinfo: {p.stdout.strip() or p.stderr.strip()});"
                                   f" slurmctld: {self.log_tail('slurmctld')} slurmd: {self.log_tail('slurmd')}")
            time.sleep(0.2)

    def _check_alive(self, name: str):
        p = self.procs[name]
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with code {p.returncode}: {self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 2000) -> str:
        text = ""
        for path in (self._path("log", f"{name}.log"), self._path("log", f"{name}.out")):
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f.read()[-n:]
        return text

    def run(self, cmd: List[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        p = subprocess.run(cmd, env=dict(os.environ, **self.env), capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    def jobs(self) -> List[str]:
        """Job ids still in the queue (pending, running or completing)."""
        p = self.run(["squeue", "-h", "-o", "%i %T"], check=False)
        return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]

    def stop(self):
        try:
            for job in self.jobs():
                self.run(["scancel", job], check=False)
        except Exception:
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.procs.clear()


def start_slurm(root: str, cpus: int = 16, gpus: int = 2, timeout: float = 60.0) -> Slurm:
    ensure_packages()
    s = Slurm(root, cpus=cpus, gpus=gpus)
    try:
        return s.start(timeout=timeout)
    except BaseException:
        s.stop()
        raise


def slurm_or_skip(root: str, **kw) -> Optional[Slurm]:
    """``start_slurm``, or ``pytest.skip`` with the reason where the packages cannot be installed."""
    import pytest

    try:
        return start_slurm(root, **kw)
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm here: {e}")
