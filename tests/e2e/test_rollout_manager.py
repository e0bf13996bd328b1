"""The rollout manager of asynchronous RL (realhf.system.rollout.manager), over real HTTP on loopback.

Signed requests only, malformed ones named, routing to the least loaded live server, weight updates on a real
fleet of two ``gen`` servers (an in-flight request is aborted with its partial output; the rest runs on the new
weights), a dead server skipped, and the process entry ``serve``. Its ticket book is tested in
test_ticket_book.py.
"""
import asyncio
import json
import os
import signal
import types
import urllib.error
import urllib.request

import pytest

from realhf.gen_server.api import GenerateRequest, SamplingParams
from realhf.gen_server.auth import sign
from realhf.base.run_secret import new_run_secret
from realhf.system.rollout.manager import RolloutManager

from support.thread_loop import Loop
from support.ticket_book_util import book_of, read_log


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.stop()


@pytest.fixture(scope="module")
def tiny():
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory):
    from realhf.gen_server.fleet import LocalFleet

    f = LocalFleet("gen", tiny, 2, threads=1, log_dir=str(tmp_path_factory.mktemp("fleet")))
    yield f
    f.stop()


@pytest.fixture(scope="module")
def perturbed(tiny, tmp_path_factory):
    from realhf.testing import perturbed_model

    return perturbed_model(tiny, str(tmp_path_factory.mktemp("ckpt")), seed=3)[1]


class Refused(Exception):
    def __init__(self, status, error):
        self.status = status
        super().__init__(f"{status}: {error}")


def raw(addr, path, body=None, headers=None):
    req = urllib.request.Request(f"http://{addr}{path}", data=body, headers=headers or {},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def signed(secret, addr, path, body: bytes):
    return raw(addr, path, body, {"Content-Type": "application/json", **sign(secret, "POST", path, body)})


def post(secret, addr, endpoint, /, **body):
    """A signed POST of ``body``; its answer, or Refused(status, error)."""
    code, out = signed(secret, addr, endpoint, json.dumps(body).encode())
    if code != 200:
        raise Refused(code, out.get("error"))
    return out


class Running:
    """A RolloutManager served on the test loop, and signed calls to it from the test's thread."""

    def __init__(self, loop, book, addresses, secret, **kw):
        self.loop, self.secret = loop, secret

        async def make():
            return RolloutManager(book, addresses, secret, **kw)

        self.mgr = loop.run(make())
        self.addr = f"127.0.0.1:{loop.run(self.mgr.start('127.0.0.1', 0))}"

    def post(self, endpoint, /, **body):
        return post(self.secret, self.addr, endpoint, **body)

    def status(self):
        return raw(self.addr, "/status")[1]

    def stop(self):
        self.loop.run(self.mgr.stop())


DUMMY = ["127.0.0.1:9", "127.0.0.1:9"]  # never contacted by these tests


def test_signed_requests_only_and_malformed_input_named(loop):
    secret = new_run_secret()
    m = Running(loop, book_of(B=2), DUMMY, secret)
    try:
        a = m.addr
        body = b'{"worker": "w0"}'
        code, out = signed(secret, a, "/allocate", body)
        assert code == 200 and out["reason"] == "ok" and out["ticket"]["id"] == 0 and out["server"] == 0
        assert raw(a, "/allocate", body, {"Content-Type": "application/json"})[0] == 401  # unsigned
        assert signed(new_run_secret(), a, "/allocate", body)[0] == 401  # another run's secret
        h = {"Content-Type": "application/json", **sign(secret, "POST", "/allocate", body)}
        assert raw(a, "/allocate", body, h)[0] == 200
        assert raw(a, "/allocate", body, h)[0] == 401  # replayed
        assert raw(a, "/allocate", b'{"worker": "w9"}', {**h, **sign(secret, "POST", "/allocate", body)})[0] == 401
        assert raw(a, "/finish", b'{"ticket": 0, "status": "accepted"}', h)[0] == 401  # signed for another path
        for path, bad, words in [("/allocate", b"not json", "not JSON"), ("/allocate", b'{"wrker": "w"}', "worker"),
                                 ("/allocate", b'{"worker": 3}', "worker"), ("/finish", b'{"ticket": "x", "status": '
                                                                                        b'"accepted"}', "ticket"),
                                 ("/finish", b'{"ticket": 99, "status": "accepted"}', "ticket 99"),
                                 ("/finish", b'{"ticket": 0, "status": "great"}', "status"),
                                 ("/finish", b'{"ticket": 0, "status": "accepted", "stats": [1]}', "stats"),
                                 ("/server_down", b'{"index": 7}', "index"),
                                 ("/update_weights", b'{"path": "/x", "version": -1}', "version"),
                                 ("/update_weights", b'{"path": 5, "version": 1}', "path")]:
            code, out = signed(secret, a, path, bad)
            assert code == 400 and words in out["error"], (path, bad, out)
        assert m.post("/finish", ticket=0, status="accepted", stats={"reward": 1.0}) == {}
        code, st = raw(a, "/status")
        assert code == 200 and st["issued"] == 2 and st["accepted"] == 1 and st["running"] == 1
        assert raw(a, "/health") == (200, {"status": "ok", "version": 0, "pid": os.getpid()})
    finally:
        m.stop()


def test_routing_and_servers_down(loop):
    m = Running(loop, book_of(B=4), DUMMY, new_run_secret())
    try:
        got = [m.post("/allocate", worker="w") for _ in range(3)]
        assert [g["server"] for g in got] == [0, 1, 0]
        m.post("/finish", ticket=got[0]["ticket"]["id"], status="failed")
        assert m.post("/allocate", worker="w")["server"] == 0  # 1 and 1 running: the lower index
        m.post("/server_down", index=0, reason="connection refused")
        assert [m.post("/allocate", worker="w")["server"] for _ in range(2)] == [1, 1]
        st = m.status()
        assert [(s["live"], s["running_episodes"]) for s in st["servers"]] == [(False, 2), (True, 3)]
        assert 0.0 <= st["idle_fraction"] <= 1.0
        released = m.post("/worker_down", worker="w", reason="exited with code -9")["released"]
        assert released == 5 and m.status()["running"] == 0
        assert [s["running_episodes"] for s in m.status()["servers"]] == [0, 0]
        with pytest.raises(Refused, match="worker must be a non-empty string"):
            m.post("/worker_down", worker="")
        m.post("/server_down", index=1, reason="gone")
        for call in (lambda: m.post("/allocate", worker="w"), lambda: m.post("/update_weights", path="/x", version=1)):
            with pytest.raises(Refused, match="every generation server is down") as e:
                call()
            assert e.value.status == 503
    finally:
        m.stop()


def _metrics(gc, i):
    return gc.dialect.metrics(gc.servers[i])


def test_weight_update_aborts_in_flight_requests_and_the_rest_runs_on_new_weights(loop, fleet, perturbed):
    """The gen engine's true behaviour under the manager's pause + abort + load + continue: a running request comes
    back with its partial output (finish_reason "abort", every token of the old version), a request waiting on the
    paused server with an empty one; the resubmitted rest runs on the new weights."""
    gc = loop.run(_gen_client(fleet))
    m = Running(loop, book_of(B=2), fleet.addresses, fleet.secret)
    prompt, max_new = [5, 6, 7], 400
    sp = dict(max_new_tokens=max_new, min_new_tokens=max_new, seed=11)
    try:
        fut, waiting = _one_running_one_waiting_on_paused_server_0(loop, gc, prompt, sp)
        out = m.post("/update_weights", path=perturbed, version=1)
        assert out["servers"] == [0, 1] and out["version"] == 1 and out["seconds"] > 0
        r = fut.result(60).outputs[0]
        assert r.finish_reason == "abort" and 0 < len(r.output_ids) < max_new and set(r.versions) == {0}
        w = waiting.result(60).outputs[0]
        assert w.finish_reason == "abort" and w.output_ids == []  # it never started: nothing generated
        assert [h["version"] for h in loop.run(gc.health())] == [1, 1]
        rest = max_new - len(r.output_ids)
        cont = loop.run(gc.generate(GenerateRequest("rest", prompt + r.output_ids, SamplingParams(
            max_new_tokens=rest, min_new_tokens=rest, seed=12)), server=0)).outputs[0]
        assert cont.finish_reason == "length" and len(cont.output_ids) == rest and set(cont.versions) == {1}
        st = m.status()
        assert st["version"] == 1 and st["weight_updates"] == 1 and [s["version"] for s in st["servers"]] == [1, 1]
        # a server that answers with an error fails the update, names itself, and is left running
        with pytest.raises(Refused, match=r"failed on server 0 .*server 1 ") as e:
            m.post("/update_weights", path=perturbed + "-missing", version=2)
        assert e.value.status == 500
        assert [x["paused"] for x in loop.run(gc.metrics())] == [False, False] and m.status()["version"] == 1
        with pytest.raises(Refused, match="lower"):
            m.post("/update_weights", path=perturbed, version=0)
    finally:
        m.stop()
        loop.run(gc.close())


def _one_running_one_waiting_on_paused_server_0(loop, gc, prompt, sp):
    """Server 0 paused with one request mid-generation and one queued behind it: their futures."""
    for attempt in range(20):  # hold a request mid-generation: pause server 0 once it has produced tokens
        base = loop.run(_metrics(gc, 0))["generated_tokens"]
        fut = loop.submit(gc.generate(GenerateRequest(f"long{attempt}", prompt, SamplingParams(**sp)), server=0))
        while loop.run(_metrics(gc, 0))["generated_tokens"] == base and not fut.done():
            pass
        loop.run(gc.dialect.pause(gc.servers[0]))
        if loop.run(_metrics(gc, 0))["running_requests"] == 1:
            break
        loop.run(gc.dialect.resume(gc.servers[0]))
        fut.result(60)  # it finished before the pause landed: try again
    else:
        pytest.fail("could not catch a request in flight")
    waiting = loop.submit(gc.generate(GenerateRequest("waiting", prompt, SamplingParams(**sp)), server=0))
    while loop.run(_metrics(gc, 0))["waiting_requests"] == 0:  # it reached the paused server
        pass
    return fut, waiting


def test_inflight_weight_update_lets_running_requests_go_on_under_the_new_weights(loop, fleet, perturbed):
    """async_rl.weight_update=inflight: the manager pauses, loads and continues without aborting; the running
    request finishes whole, its first tokens of the old version and the rest of the new one, and the waiting
    request runs on the new weights."""
    gc = loop.run(_gen_client(fleet))
    m = Running(loop, book_of(B=2), fleet.addresses, fleet.secret, interrupt=False)
    prompt, max_new = [5, 6, 7], 400
    sp = dict(max_new_tokens=max_new, min_new_tokens=max_new, seed=11)
    try:
        version = max(h["version"] for h in loop.run(gc.health())) + 1  # the fleet serves the whole module
        aborted = [x["aborted_requests"] for x in loop.run(gc.metrics())]
        fut, waiting = _one_running_one_waiting_on_paused_server_0(loop, gc, prompt, sp)
        m.post("/update_weights", path=perturbed, version=version)
        r = fut.result(120).outputs[0]
        assert r.finish_reason == "length" and len(r.output_ids) == max_new
        k = r.versions.index(version)  # the tokens before the update, then only new-version ones
        assert 0 < k < max_new and set(r.versions[:k]) == {version - 1} and set(r.versions[k:]) == {version}
        w = waiting.result(120).outputs[0]
        assert w.finish_reason == "length" and set(w.versions) == {version}
        assert [x["aborted_requests"] for x in loop.run(gc.metrics())] == aborted
    finally:
        m.stop()
        loop.run(gc.close())


async def _gen_client(fleet):
    from realhf.gen_server.client import GenClient

    return GenClient(fleet.addresses, fleet.secret)


def test_dead_server_is_skipped_by_updates_and_routing(loop, fleet, perturbed):
    """Last of the fleet's tests: it kills server 1."""
    m = Running(loop, book_of(B=2), fleet.addresses, fleet.secret)
    try:
        m.mgr.book.set_version(1)
        p = fleet.procs[1]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        out = m.post("/update_weights", path=perturbed, version=2)
        assert out["servers"] == [0]
        st = m.status()
        assert [s["live"] for s in st["servers"]] == [True, False] and st["version"] == 2
        assert raw(fleet.addresses[0], "/health")[1]["version"] == 2
        assert [m.post("/allocate", worker="w")["server"] for _ in range(3)] == [0, 0, 0]
    finally:
        m.stop()


def test_serve_registers_and_restores(loop, tmp_path):
    from realhf.api.core.system_api import GenServersSpec, RolloutSpec
    from realhf.base import name_resolve
    from realhf.base.name_resolve import names
    from realhf.base.recover import RecoverStore
    from realhf.system.rollout import manager as rollout_manager

    nr = name_resolve.make_repository("file", root=str(tmp_path / "nr"))
    for i in range(2):
        nr.add(names.gen_server("e", "t", i), DUMMY[i])
    served = types.SimpleNamespace(gen_servers=GenServersSpec(backend="gen", n_servers=2))
    spec = types.SimpleNamespace(experiment_name="e", trial_name="t", log_dir=str(tmp_path / "logs"),
                                 recover_dir=str(tmp_path / "recover"), served=lambda: served,
                                 rollout=RolloutSpec(n_workers=1, batch_size=2, dp_size=1, total_batches=5,
                                                     n_prompts=8, max_head_offpolicyness=1))
    secret = new_run_secret()

    def run_once(resume):
        stop = asyncio.Event()

        async def go():
            return await rollout_manager.serve(spec, secret, nr, resume, host="127.0.0.1", stop=stop)

        fut = loop.submit(go())
        nr_key = names.rollout_manager("e", "t")
        addr = nr.wait(nr_key, timeout=60)
        try:
            return [post(secret, addr, "/allocate", worker="w") for _ in range(4)]
        finally:
            loop.loop.call_soon_threadsafe(stop.set)
            assert fut.result(30) == 0
            nr.delete(nr_key)

    first = run_once(False)
    assert [a["ticket"]["cursor"] if a["ticket"] else a["reason"] for a in first] == [0, 1, 2, 3]
    store = RecoverStore(spec.recover_dir)
    store.commit(store.begin(1), {"global_step": 1})
    # restored at version 1, but no ticket until the trainer has published the resumed weights (the servers
    # restarted with the initial ones); which slots come back is TicketBook.restore's, tested in test_ticket_book.py
    again = run_once(True)
    assert [a["ticket"]["cursor"] if a["ticket"] else a["reason"] for a in again] == ["weights"] * 4
    assert again[0]["version"] == 1
    events = [r["event"] for r in read_log(os.path.join(spec.log_dir, "rollouts.jsonl"))]
    assert events == ["issue"] * 4 + ["restore"]


def test_a_worker_stays_while_tickets_run_elsewhere(loop):
    """No free slot but tickets running on another worker: a rollout worker keeps asking (that worker may be killed
    and its tickets come back, as in a CI run where the survivor had left and the run hung), and stops once every
    slot is accepted."""
    import time

    from realhf.system.transport.manager_client import ManagerClient
    from realhf.system.rollout.worker import RolloutWorker

    secret = new_run_secret()
    m = Running(loop, book_of(B=2, total=1, n=4), DUMMY, secret)
    w = RolloutWorker.__new__(RolloutWorker)  # only its allocation loop runs: no ticket is ever given to it
    w.name, w.manager_timeout, w.rs = "w0", 30.0, None
    w.manager = ManagerClient(m.addr, secret)
    try:
        ghost = [m.post("/allocate", worker="ghost")["ticket"] for _ in range(2)]
        assert all(ghost) and m.post("/allocate", worker="w0")["reason"] == "done"
        fut = loop.submit(w._episodes(0))
        time.sleep(1.5)
        assert not fut.done(), f"the worker left while tickets were still running elsewhere ({fut.exception()})"
        for t in ghost:
            m.post("/finish", ticket=t["id"], status="accepted")
        fut.result(30)  # every slot accepted: it stops
        assert m.status()["complete"]
    finally:
        loop.run(w.manager.close())
        m.stop()


def test_a_workers_tasks_hold_one_allocation_at_a_time(loop):
    """Six episode tasks of one rollout worker refused for staleness: one request waits in the manager, the others
    wait in the worker (held requests would otherwise take the connections the episodes' reports need); when the
    version moves the batch's two slots go to two of them, and when every slot is accepted all six return."""
    import time

    from realhf.system.transport.manager_client import ManagerClient
    from realhf.system.rollout.worker import RolloutWorker

    secret = new_run_secret()
    m = Running(loop, book_of(B=2, total=2, n=4, ofp=0), DUMMY, secret)
    w = RolloutWorker.__new__(RolloutWorker)  # its allocation alone runs here
    w.name, w.manager_timeout, w.rs = "w0", 30.0, None
    w.manager = ManagerClient(m.addr, secret)
    try:
        ghost = [m.post("/allocate", worker="ghost")["ticket"] for _ in range(2)]
        asks = [loop.submit(w._allocate()) for _ in range(6)]
        time.sleep(0.5)
        assert m.status()["allocations_held"] == 1 and not any(f.done() for f in asks)
        for t in ghost:
            m.post("/finish", ticket=t["id"], status="accepted")  # batch 1 is still one version too far

        async def new_version():
            m.mgr.book.set_version(1)
            m.mgr._changed()

        time.sleep(0.3)
        assert m.status()["allocations_held"] == 1 and not any(f.done() for f in asks)
        loop.run(new_version())
        time.sleep(0.5)
        first = [f for f in asks if f.done()]
        got = [f.result() for f in first]
        assert sorted((g["ticket"]["batch"], g["ticket"]["slot"]) for g in got) == [(1, 0), (1, 1)]
        assert m.status()["allocations_held"] == 1  # the rest: every slot is running ("done"), one asks
        for g in got:
            m.post("/finish", ticket=g["ticket"]["id"], status="accepted")
        rest = [f.result(10) for f in asks if f not in first]
        assert len(rest) == 4 and all(r["ticket"] is None and r["complete"] for r in rest)
        assert m.status()["allocations_held"] == 0
    finally:
        loop.run(w.manager.close())
        m.stop()


def test_a_held_allocation_gets_its_ticket_when_the_version_moves(loop, fleet, perturbed):
    """``wait_s``: a worker's request refused for staleness is held, not answered, and gets its ticket as soon as new
    weights load (a worker polling with back-off got it up to half a second late: a tiny asynchronous run's
    throughput was 0.53-0.62x of colocated with polling, 0.86-1.06x held); one held past ``wait_s`` gets the refusal; a ticket's end (here a failure) wakes a
    request refused because every slot was taken. Runs after the fleet lost server 1 (server 0 alone)."""
    import time

    v = raw(fleet.addresses[0], "/health")[1]["version"] + 1  # the version to load; the server holds v - 1
    m = Running(loop, book_of(B=2, total=v + 2, ofp=0), fleet.addresses[:1], fleet.secret)
    try:
        m.mgr.book.set_version(v - 1)
        taken = []
        while (got := m.post("/allocate", worker="w"))["ticket"] is not None:
            taken.append(got["ticket"])
        assert got["reason"] == "staleness" and [t["batch"] for t in taken] == [b for b in range(v) for _ in "ab"]
        t0 = time.monotonic()
        refused = m.post("/allocate", worker="w", wait_s=0.3)
        assert refused["ticket"] is None and refused["reason"] == "staleness" and time.monotonic() - t0 >= 0.3
        held = loop.submit(asyncio.to_thread(m.post, "/allocate", worker="w", wait_s=20))
        for t in taken:
            m.post("/finish", ticket=t["id"], status="accepted")  # wakes the held request: still too stale
        time.sleep(0.5)
        assert not held.done(), "answered before the version moved"
        m.post("/update_weights", path=perturbed, version=v)
        got = held.result(10)
        assert got["ticket"] is not None and got["ticket"]["batch"] == v and got["version"] == v
        other = m.post("/allocate", worker="w")["ticket"]
        assert other["batch"] == v
        # the last batch's slots both running: "done" until one of them fails and its slot comes back
        m.mgr.book.set_version(v + 1)
        last = [m.post("/allocate", worker="w")["ticket"] for _ in range(2)]
        assert [t["batch"] for t in last] == [v + 1] * 2 and m.post("/allocate", worker="w")["reason"] == "done"
        held = loop.submit(asyncio.to_thread(m.post, "/allocate", worker="w", wait_s=20))
        time.sleep(0.3)
        assert not held.done()
        m.post("/finish", ticket=last[1]["id"], status="failed")
        again = held.result(10)["ticket"]
        assert again is not None and (again["batch"], again["slot"]) == (v + 1, last[1]["slot"])
        for bad in (-1, "5", True, 31):
            with pytest.raises(Refused, match="wait_s") as e:
                m.post("/allocate", worker="w", wait_s=bad)
            assert e.value.status == 400
    finally:
        m.stop()
