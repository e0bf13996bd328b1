"""``scripts/ray_cluster.sh`` for real: a private ``sshd`` on 127.0.0.1 (temporary host key, config and
authorized_keys, all in a temp dir, stopped by PID), then ``start`` brings up a Ray head and a worker (both on this
machine, the worker with ports of its own), ``status`` shows them, ``stop`` leaves none of this cluster's
processes. A non-default GCS port and a private Ray temp dir keep other Ray instances of this machine out of it;
skipped with the reason where sshd cannot be installed."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from realhf.base import network
from realhf.base.process import source_root

ROOT = source_root()
SCRIPT = os.path.join(ROOT, "scripts", "ray_cluster.sh")


def _ensure_openssh():
    if shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"):
        if shutil.which("ssh") and shutil.which("ssh-keygen"):
            return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("openssh-server is not installed and cannot be (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "openssh-server", "openssh-client"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        pytest.skip(f"cannot install openssh-server: {(p.stderr or p.stdout)[-500:]}")


def _wait_port(port: int, proc: subprocess.Popen, log: str, timeout: float = 20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited ({proc.returncode}): {open(log).read()[-1000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd did not listen on {port}: {open(log).read()[-1000:]}")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A private sshd on 127.0.0.1:<free port> accepting root by key; yields the ``--ssh`` command for it."""
    _ensure_openssh()
    d = tmp_path_factory.mktemp("sshd")
    for name in ("hostkey", "clientkey"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True, timeout=30)
    shutil.copy(d / "clientkey.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o600)
    port = network.find_free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'hostkey'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PrintMotd no", ""]))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory (made by systemd elsewhere)
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    log = str(d / "sshd.log")
    proc = subprocess.Popen([sshd_bin, "-D", "-f", str(d / "sshd_config"), "-E", log], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_port(port, proc, log)
        ssh = (f"ssh -p {port} -i {d / 'clientkey'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
               "-o BatchMode=yes -o ConnectTimeout=10 -o LogLevel=ERROR")
        p = subprocess.run(ssh.split() + ["127.0.0.1", "true"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"ssh to the private sshd failed: {p.stderr}; sshd log: {open(log).read()[-1000:]}"
        yield ssh
    finally:
        proc.terminate()  # the listener; sessions it forked have ended with their commands
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def script(*args, timeout=300):
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p, p.stdout + p.stderr


def cluster_pids(port: int, temp_dir: str):
    """PIDs of this machine's processes of the test's Ray cluster (its GCS port or its temp dir)."""
    from realhf.apps.cluster.ray_cluster import _cluster_pattern

    pat, pids = _cluster_pattern(port), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pat.search(cmd) or temp_dir in cmd:
            pids.append(int(pid))
    return pids


@pytest.mark.slow  # ~25 s: sshd, a Ray head and a worker
def test_start_status_stop(sshd, tmp_path):
    port = network.find_free_port("0.0.0.0")
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths below it must fit 107 bytes
    hosts = ["--head", "127.0.0.1", "--workers", "127.0.0.1", "--port", str(port), "--ssh", sshd]
    try:
        p, out = script("start", *hosts, "--temp-dir", temp_dir, "--isolated", "--num-cpus", "1",
                        "--fileroot", str(tmp_path / "fileroot"), "--check-timeout", "60")
        assert p.returncode == 0, out
        assert f"Ray cluster up: 2 node(s) at 127.0.0.1:{port}" in out
        assert "READY: 2 node(s) answered" in out  # check_cluster in ray mode: shared dir and ports between nodes
        assert f"mode=ray ray_address=127.0.0.1:{port} n_nodes=2" in out and "ready: run with" in out
        p, out = script("status", *hosts)
        assert p.returncode == 0, out
        assert "127.0.0.1: raylet running" in out and "Active:" in out
    finally:
        p, out = script("stop", *hosts, "--grace", "5")
        left = cluster_pids(port, temp_dir)
        for pid in left:  # processes of the cluster this test started, if stop missed any
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert p.returncode == 0, out
    assert "Ray process(es) of the cluster on port" in out
    assert not left, f"ray processes left after stop: {left}"


def test_unreachable_host_fails_fast(tmp_path):
    if not shutil.which("ssh"):
        pytest.skip("no ssh client here")
    closed = network.find_free_port()
    t0 = time.monotonic()
    p, out = script("start", "--head", "127.0.0.1", "--port", str(network.find_free_port()),
                    "--ssh", f"ssh -p {closed} -o BatchMode=yes -o ConnectTimeout=5", timeout=60)
    assert p.returncode == 1, out
    assert "error: 127.0.0.1: ssh failed" in out and "Connection refused" in out
    assert time.monotonic() - t0 < 30
