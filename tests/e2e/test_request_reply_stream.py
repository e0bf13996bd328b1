"""The authenticated ZMQ request/reply stream and heartbeats, with real worker processes on 127.0.0.1."""
import json
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import zmq

from realhf.base.name_resolve import FileNameResolve, names
from realhf.system.transport.heartbeat import HeartbeatMonitor, HeartbeatSender, _encode_beat
from realhf.base.run_secret import new_run_secret, run_secret_from_env
from realhf.base.wire import MAGIC, encode_payload
from realhf.system.transport.request_reply_stream import (
    MasterClient,
    Payload,
    WorkerError,
    WorkerLostError,
    WorkerServer,
)

EXP, TRIAL = "test-rrs", "t0"
WORKER_MAX_LIFETIME = 90  # a worker exits on its own after this, whatever happens to the test


# ------------------------------------------------------------------------ worker process (spawned)
def _worker_main(name, secret_hex, nr_root, log_path, hb_interval):
    import logging as std_logging

    from realhf.base import logging

    log = logging.getLogger("realhf")
    fh = std_logging.FileHandler(log_path)
    fh.setFormatter(std_logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log.addHandler(fh)

    secret = run_secret_from_env({"REALHF_RUN_SECRET": secret_hex})
    repo = FileNameResolve(nr_root)
    hb_addr = repo.wait(names.master_heartbeat(EXP, TRIAL), timeout=30)
    server = WorkerServer(name, secret, name_resolve=repo, key=names.worker_address(EXP, TRIAL, name))
    hb = HeartbeatSender(name, secret, hb_addr, interval=hb_interval)
    hb.start()
    received = []

    def echo(req):
        return dict(req.data, worker=name), req.tensors

    def record(req):
        received.append(req.data["tag"])
        return {}

    def fail(req):
        raise ValueError(f"boom {req.data['msg']}")

    def sleep(req):
        time.sleep(req.data["s"])
        return {}

    handlers = {
        "echo": echo,
        "record": record,
        "received": lambda req: {"tags": received},
        "status": lambda req: {"n_rejected": server.n_rejected, "pid": os.getpid()},
        "raise": fail,
        "sleep": sleep,
    }
    deadline = time.monotonic() + WORKER_MAX_LIFETIME
    try:
        while time.monotonic() < deadline:
            got = server.poll(0.1)
            if got is None:
                continue
            peer, req = got
            if req.handle_name == "exit":
                server.reply(peer, req.make_reply())
                break
            hb.set_status(req.handle_name)
            server.handle(peer, req, lambda r: handlers[r.handle_name](r))
            hb.set_status(None)
    finally:
        hb.stop()
        server.close()


# ------------------------------------------------------------------------------------ fixtures
class _Cluster:
    def __init__(self, tmp, worker_names, hb_interval=0.5, lost_after=5.0):
        self.secret = new_run_secret()
        self.root = str(tmp / "nr")
        self.repo = FileNameResolve(self.root)
        self.repo.clear_subtree(names.trial_root(EXP, TRIAL))
        self.monitor = HeartbeatMonitor(self.secret, name_resolve=self.repo, key=names.master_heartbeat(EXP, TRIAL))
        ctx = mp.get_context("spawn")
        self.logs = {w: str(tmp / f"{w}.log") for w in worker_names}
        self.procs = {
            w: ctx.Process(target=_worker_main, args=(w, self.secret.hex(), self.root, self.logs[w], hb_interval),
                           name=w, daemon=True)
            for w in worker_names
        }
        self.client = None
        for p in self.procs.values():
            p.start()
        try:
            addresses = {w: self.repo.wait(names.worker_address(EXP, TRIAL, w), timeout=60) for w in worker_names}
            self.client = MasterClient(self.secret, addresses, heartbeat=self.monitor, lost_after=lost_after)
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.client is not None:
            alive = {w: {} for w, p in self.procs.items() if p.is_alive()}
            try:
                if alive:
                    self.client.call("exit", alive, timeout=5)
            except (TimeoutError, WorkerLostError, WorkerError):
                pass
            self.client.close()
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.monitor.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # "w-kill" is SIGKILLed by test_killed_worker_is_reported; it starts with the others to save time
    c = _Cluster(tmp_path_factory.mktemp("rrs"), ["w0", "w1", "w-kill"], hb_interval=0.3, lost_after=4.0)
    yield c
    c.close()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------- tests
def test_round_trip_every_dtype_bit_exact(cluster):
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 3.14159])
    tensors = [
        torch.tensor([True, False, True]),
        torch.arange(256, dtype=torch.int64).to(torch.uint8),
        torch.tensor([-128, 0, 127], dtype=torch.int8),
        torch.tensor([-32768, 1, 32767], dtype=torch.int16),
        torch.tensor([-(2**31), 5, 2**31 - 1], dtype=torch.int32),
        torch.tensor([-(2**63), 7, 2**63 - 1], dtype=torch.int64),
        special.to(torch.float16),
        special.to(torch.bfloat16),
        special.to(torch.float32),
        special.to(torch.float64),
        torch.randn(4, 6, dtype=torch.float64).t(),  # non-contiguous
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
        torch.empty(0, 3, dtype=torch.int32),  # empty
        torch.randn(2, 3, 4).to(torch.bfloat16),
    ]
    data = {"nested": {"list": [1, 2.5, None, True, "π"], "empty": {}}, "big": 2**62}
    out = cluster.client.call("echo", {"w0": data}, {"w0": tensors}, timeout=30)["w0"]
    assert out.error is None
    assert out.data == dict(data, worker="w0")
    assert len(out.tensors) == len(tensors)
    for i, (a, b) in enumerate(zip(tensors, out.tensors)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.device.type == "cpu", i
        assert _bits(a) == _bits(b), f"tensor {i} ({a.dtype}) not bit-exact"


def test_send_checks_plain_json_and_dtypes(cluster):
    with pytest.raises(TypeError, match=r"data\['x'\]\[1\]"):
        cluster.client.call("echo", {"w0": {"x": [1, object()]}}, timeout=5)
    with pytest.raises(TypeError, match="complex64"):
        cluster.client.call("echo", {"w0": {}}, {"w0": [torch.zeros(2, dtype=torch.complex64)]}, timeout=5)
    with pytest.raises(ValueError, match="unknown worker"):
        cluster.client.send([Payload("nobody", "echo")])


def test_concurrent_calls_from_two_threads(cluster):
    errors, results = [], {}

    def run(k):
        try:
            for i in range(15):
                w = "w0" if (i + k) % 2 == 0 else "w1"
                out = cluster.client.call(
                    "echo", {w: {"thread": k, "i": i}}, {w: [torch.full((i + 1,), k, dtype=torch.int32)]}, timeout=30
                )[w]
                results[(k, i)] = (out.data, out.tensors[0])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a calling thread hung"
    assert not errors, errors
    for (k, i), (data, tensor) in results.items():
        assert data["thread"] == k and data["i"] == i
        assert data["worker"] == ("w0" if (i + k) % 2 == 0 else "w1")
        assert torch.equal(tensor, torch.full((i + 1,), k, dtype=torch.int32))
    assert len(results) == 30


def test_gather_in_any_order(cluster):
    ps = [Payload("w0" if i % 2 else "w1", "echo", {"i": i}) for i in range(6)]
    cluster.client.send(ps)
    later = cluster.client.gather([ps[5].request_id, ps[4].request_id], timeout=30)
    first = cluster.client.gather([p.request_id for p in ps[:4]], timeout=30)
    got = {**later, **first}
    assert [got[p.request_id].data["i"] for p in ps] == list(range(6))
    with pytest.raises(KeyError):
        cluster.client.gather([ps[0].request_id], timeout=1)  # already gathered


def test_lists_keep_relative_order_on_every_worker(cluster):
    cluster.client.call("received", {"w0": {}, "w1": {}}, timeout=30)  # drain earlier state

    def run(k):
        ids = []
        for j in range(10):
            ps = [Payload(w, "record", {"tag": f"{k}-{j}"}) for w in ("w0", "w1")]
            cluster.client.send(ps)
            ids += [p.request_id for p in ps]
        cluster.client.gather(ids, timeout=30)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    tags = cluster.client.call("received", {"w0": {}, "w1": {}}, timeout=30)
    order0, order1 = tags["w0"].data["tags"][-20:], tags["w1"].data["tags"][-20:]
    assert sorted(order0) == sorted(f"{k}-{j}" for k in range(2) for j in range(10))
    assert order0 == order1


def test_handler_error_is_worker_error(cluster):
    with pytest.raises(WorkerError) as ei:
        cluster.client.call("raise", {"w1": {"msg": "xyz-123"}}, timeout=30)
    e = ei.value
    assert e.worker == "w1"
    assert "Traceback" in e.traceback and "ValueError: boom xyz-123" in e.traceback
    assert "w1" in str(e) and "boom xyz-123" in str(e)
    # unknown handler names are errors too, and the worker keeps serving
    with pytest.raises(WorkerError, match="no-such-handler"):
        cluster.client.call("no-such-handler", {"w1": {}}, timeout=30)
    assert cluster.client.call("echo", {"w1": {"ok": 1}}, timeout=30)["w1"].data["ok"] == 1


def test_forged_messages_rejected(cluster):
    n0 = cluster.client.call("status", {"w0": {}}, timeout=30)["w0"].data["n_rejected"]
    wrong = new_run_secret()
    good = encode_payload(cluster.secret, Payload("w0", "echo", {"x": 1}))
    header = json.loads(bytes(good[2]))
    tampered = [bytes(f) for f in good]
    tampered[2] = json.dumps(dict(header, data={"x": 2})).encode()
    forged = [
        [b"garbage", b"\x00\xff" * 10],  # (a) garbage frames
        encode_payload(wrong, Payload("w0", "status")),  # (b) well formed, signed with the wrong secret
        [MAGIC, json.dumps(header).encode()],  # (c) a valid-looking header without a signature
        tampered,  # (d) a genuine signature over a different header
        [MAGIC, bytes(good[1]), bytes(good[2]), b"extra frame"],  # (e) an appended frame
    ]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"forger-XYZ")
    sock.connect(cluster.client.addresses["w0"])
    try:
        for frames in forged:
            sock.send_multipart(frames)
        deadline = time.monotonic() + 15
        while True:
            n = cluster.client.call("status", {"w0": {}}, timeout=30)["w0"].data["n_rejected"]
            if n >= n0 + len(forged) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert n == n0 + len(forged)
        assert sock.poll(300) == 0, "the worker answered a forged message"
    finally:
        sock.close(linger=0)
    with open(cluster.logs["w0"]) as f:
        log = f.read()
    assert log.count("rejected a message from peer b'forger-XYZ'") == len(forged), log
    assert "bad signature" in log and "bad magic" in log and "expected at least 3 frames" in log
    # ... and the worker still serves genuine requests
    out = cluster.client.call("echo", {"w0": {"after": True}}, timeout=30)["w0"]
    assert out.data["after"] is True


def _dealer(cluster, worker, identity):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(cluster.client.addresses[worker])
    return sock


def test_replayed_and_stale_requests_are_rejected(cluster):
    """A captured, correctly signed request sent again is not executed, nor is one sent long ago."""
    from realhf.base.wire import REPLAY_WINDOW_SECS, decode_payload

    sock = _dealer(cluster, "w1", b"replayer")
    n0 = cluster.client.call("status", {"w1": {}}, timeout=30)["w1"].data["n_rejected"]
    try:
        captured = [bytes(f) for f in encode_payload(cluster.secret, Payload("w1", "record", {"tag": "once"}))]
        header = json.loads(captured[2])
        header["ts"] -= REPLAY_WINDOW_SECS + 60
        old = encode_payload(cluster.secret, Payload("w1", "record", {"tag": "old"}))
        old_header = json.loads(bytes(old[2]))
        old_header["ts"] = header["ts"]
        from realhf.base.wire import sign_frames

        stale = sign_frames(cluster.secret, [json.dumps(old_header).encode()])
        for frames in (captured, captured, stale, captured):
            sock.send_multipart(frames)
        # requests are served in order: the reply to a fresh one after them proves the others were dropped
        sock.send_multipart(encode_payload(cluster.secret, Payload("w1", "received", {})))
        replies = []
        while True:
            assert sock.poll(30000), "no reply from the worker"
            r = decode_payload(cluster.secret, sock.recv_multipart())
            replies.append(r.handle_name)
            if r.handle_name == "received":
                break
        assert replies == ["record", "received"], replies
        assert r.data["tags"].count("once") == 1 and "old" not in r.data["tags"]
    finally:
        sock.close(linger=0)
    n = cluster.client.call("status", {"w1": {}}, timeout=30)["w1"].data["n_rejected"]
    assert n == n0 + 3
    with open(cluster.logs["w1"]) as f:
        log = f.read()
    assert log.count("replayed request id") == 2 and "stale message" in log


def test_an_oversized_frame_is_dropped_before_it_is_buffered(cluster):
    """An unauthenticated 256 MiB frame does not grow the worker by its size; the worker keeps serving."""
    from realhf.base.wire import MAX_FRAME_BYTES

    pid = cluster.client.call("status", {"w0": {}}, timeout=30)["w0"].data["pid"]

    def peak_rss():  # the kernel's high-water mark of the worker's resident memory, in bytes
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:"))

    hwm0 = peak_rss()
    sock = _dealer(cluster, "w0", b"flooder")
    try:
        sock.send_multipart([MAGIC, b"\0" * 32, bytes(256 << 20)], copy=False)
        # the worker serves genuine requests meanwhile and after
        for _ in range(20):
            assert cluster.client.call("echo", {"w0": {"ok": 1}}, timeout=30)["w0"].data["ok"] == 1
            time.sleep(0.05)
        grown = peak_rss() - hwm0
    finally:
        sock.close(linger=0)
    assert grown < 64 << 20, f"the worker's peak memory grew by {grown >> 20} MiB on a rejected frame"
    with pytest.raises(ValueError, match="frame limit"):
        encode_payload(cluster.secret, Payload("w0", "echo", {}, tensors=[torch.zeros(MAX_FRAME_BYTES // 4 + 1)]))


def test_heartbeats_forged_and_replayed(cluster):
    secret = new_run_secret()
    mon = HeartbeatMonitor(secret)
    good = HeartbeatSender("hb-good", secret, mon.address, interval=0.1)
    bad = HeartbeatSender("hb-bad", new_run_secret(), mon.address, interval=0.1)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(mon.address)
    try:
        good.start()
        bad.start()
        good.set_status("generate")
        beat = _encode_beat(secret, "hb-replay", 1234, None)
        sock.send_multipart([bytes(f) for f in beat])
        sock.send_multipart([bytes(f) for f in beat])  # replay
        sock.send_multipart([b"junk"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (mon.last_seen("hb-good") is None or mon.n_rejected < 4):
            time.sleep(0.05)
        assert mon.last_seen("hb-good") is not None
        assert mon.last_seen("hb-replay") is not None
        assert mon.last_seen("hb-bad") is None and mon.n_rejected >= 4
        assert mon.dead_workers(["hb-good"], timeout_s=5) == []
        time.sleep(0.3)
        assert mon.status("hb-good") == "generate"
        good.stop()
        time.sleep(0.4)
        assert mon.dead_workers(["hb-good", "hb-bad"], timeout_s=0.3) == ["hb-good", "hb-bad"]
    finally:
        good.stop()
        bad.stop()
        sock.close(linger=0)
        mon.close()


def test_killed_worker_is_reported(cluster):
    c = cluster
    pid = c.client.call("status", {"w-kill": {}}, timeout=30)["w-kill"].data["pid"]
    p = Payload("w-kill", "sleep", {"s": 60})
    c.client.send([p])
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerLostError) as ei:  # not TimeoutError: the loss is noticed before the gather's limit
        c.client.gather([p.request_id], timeout=20)
    assert ei.value.worker == "w-kill" and "w-kill" in str(ei.value)
    assert "sleep" in ei.value.reason  # the last status the heartbeat carried
    # the other workers are unaffected
    assert c.client.call("echo", {"w0": {"a": 1}, "w1": {"a": 2}}, timeout=30)["w1"].data["a"] == 2
    # a new request to the dead worker fails fast too
    with pytest.raises(WorkerLostError, match="w-kill"):
        c.client.call("echo", {"w-kill": {}}, timeout=20)


def test_mark_dead_and_timeout(cluster):
    p = Payload("w1", "sleep", {"s": 1.0})
    cluster.client.send([p])
    with pytest.raises(TimeoutError, match="w1"):
        cluster.client.gather([p.request_id], timeout=0.2)
    assert cluster.client.gather([p.request_id], timeout=30)[p.request_id].error is None
    client = MasterClient(cluster.secret, {"ghost": "tcp://127.0.0.1:1"})
    try:
        q = Payload("ghost", "echo")
        client.send([q])
        threading.Timer(0.2, client.mark_dead, args=("ghost", "exit code -9")).start()
        with pytest.raises(WorkerLostError, match="exit code -9"):
            client.gather([q.request_id], timeout=10)
    finally:
        client.close()


def test_run_secret_from_env():
    with pytest.raises(RuntimeError, match="REALHF_RUN_SECRET"):
        run_secret_from_env({})
    with pytest.raises(RuntimeError, match="hex"):
        run_secret_from_env({"REALHF_RUN_SECRET": "zz"})
    with pytest.raises(ValueError, match="at least"):
        run_secret_from_env({"REALHF_RUN_SECRET": "abcd"})
    s = new_run_secret()
    assert run_secret_from_env({"REALHF_RUN_SECRET": s.hex()}) == s
