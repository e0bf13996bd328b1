"""Signed HTTP services (generation servers, the rollout manager) against strangers on the same machine.

A real aiohttp application served by ``serve_app`` with a ``signed_route`` (in a subprocess, with an open-file
limit of 1,024 and short timeouts) and a real generation server on a tiny model, driven over raw sockets:
connections that never finish their headers are closed by the header timeout (and beyond the connection cap make
room) while a signed request is still served; a trickled body is cut off; unsigned or forged requests with large
bodies are refused without the body being read, so the server does not grow; a send time that is not a finite
number is refused, and so is JSON nested too deeply to parse.
"""
import hashlib
import hmac
import json
import os
import resource
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from realhf.gen_server.auth import sign
from realhf.base.run_secret import new_run_secret

SECRET = new_run_secret()
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 1.5, 1.5, 512
N_HANGING = 1100  # more than the test app's 1,024 open files and its connection cap

APP = textwrap.dedent(f"""
    import asyncio, os, resource, sys
    from aiohttp import web
    from realhf.base import logging
    from realhf.gen_server.auth import RequestVerifier, serve_app, signed_route
    from realhf.base.wire import RejectionLog

    async def echo(d):
        return {{"keys": sorted(d)}}

    async def main(addr_file):
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)  # the usual default
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        secret = bytes.fromhex(os.environ["REALHF_RUN_SECRET"])
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/echo", signed_route(RequestVerifier(secret), RejectionLog("test app"), "/echo", echo,
                                                  (ValueError,), logging.getLogger("test app")))
        _, port = await serve_app(app, "127.0.0.1", 0, "test app", header_timeout={HEADER_TIMEOUT},
                                  body_timeout={BODY_TIMEOUT}, max_connections={MAX_CONNECTIONS})
        with open(addr_file + ".tmp", "w") as f:
            f.write(f"127.0.0.1:{{port}}")
        os.replace(addr_file + ".tmp", addr_file)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1]))
""")


def _launch(cmd, tmp, name):
    addr_file = os.path.join(str(tmp), f"{name}.addr")
    log = os.path.join(str(tmp), f"{name}.log")
    env = dict(os.environ, REALHF_RUN_SECRET=SECRET.hex(), OMP_NUM_THREADS="1")
    env.pop("REALHF_HOST", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd + [addr_file], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, addr_file, log


def _wait_up(proc, addr_file, log):
    t0 = time.time()
    while not os.path.exists(addr_file):
        if proc.poll() is not None:
            raise RuntimeError(f"{addr_file} exited {proc.returncode}:\n{open(log).read()[-3000:]}")
        assert time.time() - t0 < 300, f"{addr_file}: no server came up"
        time.sleep(0.05)
    host, port = open(addr_file).read().rsplit(":", 1)
    return host, int(port)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The test app and a generation server on a tiny model, started side by side."""
    from realhf.impl.model.tiny import ensure_tiny_model

    tmp = tmp_path_factory.mktemp("servers")
    (tmp / "app.py").write_text(APP)
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    started = [_launch([sys.executable, str(tmp / "app.py")], tmp, "app"),
               _launch([sys.executable, "-m", "realhf.gen_server.server", "--backend", "gen", "--model", model,
                        "--max-model-len", "512", "--address-file"], tmp, "gen")]
    try:
        yield {name: (p[0], _wait_up(*p)) for name, p in zip(("app", "gen"), started)}
    finally:
        _stop([p[0] for p in started])


@pytest.fixture
def app_server(servers):
    return servers["app"]


@pytest.fixture
def gen_server(servers):
    return servers["gen"]


def _post(addr, path, body: bytes, headers, timeout=20.0):
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _signed_post(addr, path, data):
    body = json.dumps(data).encode()
    return _post(addr, path, body, sign(SECRET, "POST", path, body))


def _rss_mb(pid) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _wait_closed(socks, timeout: float) -> int:
    """How many of ``socks`` the peer closed (EOF or reset) within ``timeout`` seconds."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
    sel.close()
    return closed


def test_connections_that_never_finish_their_headers_are_closed_and_signed_clients_served(app_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < N_HANGING + 256:
        if hard != resource.RLIM_INFINITY and hard < N_HANGING + 256:
            pytest.skip(f"the open-file limit ({hard}) is too low to hold {N_HANGING} connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (N_HANGING + 256, hard))
    _, addr = app_server
    socks = []
    try:
        for _ in range(N_HANGING):
            s = socket.create_connection(addr, timeout=10)
            s.sendall(b"POST /ec")  # half a request line, never finished
            socks.append(s)
        # strangers hold more connections than the server may open files, and a signed client is still served
        assert _signed_post(addr, "/echo", {"a": 1}) == (200, {"keys": ["a"]})
        assert _wait_closed(socks, HEADER_TIMEOUT + 20) == N_HANGING
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _signed_post(addr, "/echo", {"b": 2}) == (200, {"keys": ["b"]})


def test_a_trickled_body_is_cut_off(app_server):
    _, addr = app_server
    body = json.dumps({"x": "y" * 1000}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in sign(SECRET, "POST", "/echo", body).items())
    s = socket.create_connection(addr, timeout=BODY_TIMEOUT + 20)
    try:
        s.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n{head}\r\n".encode() + body[:10])
        answer = b""
        while True:
            chunk = s.recv(4096)  # the server answers and closes; the socket timeout fails a server that waits
            if not chunk:
                break
            answer += chunk
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive within" in answer


def _forged_headers(path: str) -> dict:
    """Signature headers of the right shape and time, under a secret nobody shares."""
    h = sign(secrets.token_bytes(32), "POST", path, b"{}")
    h["X-Realhf-Body-SHA256"] = hashlib.sha256(b"something else").hexdigest()
    return h


def test_strangers_bodies_do_not_grow_a_generation_server(gen_server):
    proc, addr = gen_server
    n, each, declared = 64, 4 << 20, 63 << 20
    assert _signed_post(addr, "/abort", {"rids": []})[0] == 200
    rss0 = _rss_mb(proc.pid)
    chunk = b"x" * (256 << 10)
    socks, sent = [], {}
    try:
        for i in range(n):
            sig = "" if i % 2 else "".join(f"{k}: {v}\r\n" for k, v in _forged_headers("/generate").items())
            s = socket.create_connection(addr, timeout=10)
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {declared}\r\n{sig}\r\n".encode())
            s.setblocking(False)
            socks.append(s)
            sent[s] = 0
        sel = selectors.DefaultSelector()
        for s in socks:
            sel.register(s, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 30
        while sel.get_map() and time.monotonic() < deadline:  # push up to 4 MB into each, as the server takes it
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj
                try:
                    sent[s] += s.send(chunk)
                except BlockingIOError:
                    continue
                except OSError:  # refused and closed by the server
                    sent[s] = each
                if sent[s] >= each:
                    sel.unregister(s)
        sel.close()
        # the bodies are still held open: the server has not grown, and a signed request is answered
        held = _rss_mb(proc.pid)
        assert _signed_post(addr, "/abort", {"rids": []}) == (200, {"aborted": 0})
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    after = _rss_mb(proc.pid)
    assert held - rss0 <= 64 and after - rss0 <= 64, (rss0, held, after)


def test_endless_headers_are_cut_off(gen_server):
    _, addr = gen_server
    s = socket.create_connection(addr, timeout=10)  # well under the server's 20 s header timeout
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        for i in range(100):  # each line within aiohttp's own limits, 800 KB in all
            s.sendall(f"X-Filler-{i}: {'a' * 8000}\r\n".encode())
        answer = s.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        answer = b""
    finally:
        s.close()
    assert answer == b""  # closed without an answer
    assert _signed_post(addr, "/abort", {"rids": []}) == (200, {"aborted": 0})


def _sign_with_time(path: str, body: bytes, ts: str) -> dict:
    """Authentic signature headers (the documented HMAC under the run secret) with the send time ``ts``."""
    nonce, digest = secrets.token_hex(16), hashlib.sha256(body).hexdigest()
    msg = "\n".join(["POST", path, ts, nonce, digest]).encode()
    return {"X-Realhf-Time": ts, "X-Realhf-Nonce": nonce, "X-Realhf-Body-SHA256": digest,
            "X-Realhf-Signature": hmac.new(SECRET, msg, hashlib.sha256).hexdigest()}


def test_non_finite_times_and_too_deep_json_are_refused(gen_server):
    from realhf.base.wire import Payload, RejectedMessage, ReplayGuard

    _, addr = gen_server
    for ts in ("nan", "NaN", "inf", "-inf"):
        code, ans = _post(addr, "/pause", b"{}", _sign_with_time("/pause", b"{}", ts))
        assert code == 401 and "finite" in ans["error"], (ts, code, ans)
    # the request/reply stream's freshness check is the same one
    with pytest.raises(RejectedMessage, match="finite"):
        ReplayGuard().check(Payload(handler="h", handle_name="x", data=None, request_id="r", sent_at=float("nan")))
    deep = b"[" * 100_000 + b"]" * 100_000
    code, ans = _post(addr, "/generate", deep, sign(SECRET, "POST", "/generate", deep))
    assert code == 400 and "nested too deeply" in ans["error"], (code, ans)
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=20) as r:
        metrics = json.loads(r.read())
    assert metrics["paused"] is False  # the refused pauses did nothing
