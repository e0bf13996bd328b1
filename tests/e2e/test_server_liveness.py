"""No silent stall: a generation server that runs but serves nothing, and background work that fails, end the run
with a named error.

* The launcher's watch (``realhf.gen_server.liveness.ServerWatch``) over real HTTP server processes: a server whose
  ``/health`` reports a stuck engine is named at once; one stopped with SIGSTOP is named within the limit and is live
  again once continued. ``/health``'s engine progress (``EngineProgress``) counts only time with work and no token.
* A worker's failed background work (``HeartbeatSender.report_failure``) makes the master's monitor count the worker
  as dead, with the failure as the reason; a weight publish behind training that fails reports at once, naming the
  version, the checkpoint folder and the cause.
* End to end (tiny async-ppo-math): after a step, SIGSTOP of the only generation server ends the run with exit code 1
  within ``gen_server.health_timeout_secs`` (5 s) plus slack, naming the server, its address and its log; the recover
  checkpoint that run left, with a NaN written into its actor weights, fails the resumed run within 60 s naming the
  file, where both used to hang without a word. (Slow: the server stopped as soon as it serves.)
"""
import os
import re
import signal
import time

import pytest


# ------------------------------------------------------------------------------------------ the watch
# a real HTTP server process answering /health as a generation server does, with a fixed engine stall
_HEALTH_SERVER = """
import sys
from aiohttp import web

async def health(request):
    return web.json_response({"status": "ok", "stalled_s": float(sys.argv[2])})

app = web.Application()
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def _health_server(stalled_s: float):
    import subprocess
    import sys
    import urllib.request

    from realhf.testing import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _HEALTH_SERVER, str(port), str(stalled_s)])
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            assert proc.poll() is None and time.monotonic() - t0 < 30, "the /health server did not start"
            time.sleep(0.05)


def test_the_watch_names_a_stopped_server_and_a_stuck_engine_and_sees_a_continued_server_live():
    from realhf.gen_server.liveness import ServerWatch

    procs = []
    try:
        (ok, ok_addr), (stuck, stuck_addr) = [_health_server(s) for s in (0.0, 100.0)]
        procs = [ok, stuck]
        watch = ServerWatch([ok_addr, stuck_addr], b"s" * 32, "gen", timeout_s=2.0, interval=0.2)
        try:
            t0 = time.monotonic()
            while not watch.not_live():  # the stuck engine: at its first answer
                assert time.monotonic() - t0 < 15, "a stuck engine was never found not live"
                time.sleep(0.05)
            ((i, why),) = watch.not_live("gen_server.health_timeout_secs")
            assert i == 1 and "produced no token for 100.0 s" in why and "engine is stuck" in why, why
            watch.ignore(1)
            os.kill(ok.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                while not watch.not_live():
                    assert time.monotonic() - t0 < 15, "a stopped server was never found not live"
                    time.sleep(0.05)
                waited = time.monotonic() - t0
                ((i, why),) = watch.not_live("gen_server.health_timeout_secs")
            finally:
                os.kill(ok.pid, signal.SIGCONT)
            assert i == 0 and 1.5 <= waited < 10, f"found not live after {waited:.1f} s (limit 2 s)"
            assert "answered no /health" in why and "gen_server.health_timeout_secs=2" in why, why
            t0 = time.monotonic()
            while watch.not_live():
                assert time.monotonic() - t0 < 15, "a continued server stayed not live"
                time.sleep(0.05)
        finally:
            watch.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_engine_progress_counts_only_time_with_work_and_no_token():
    from realhf.gen_server.liveness import EngineProgress

    p = EngineProgress()
    busy = dict(running_requests=1, waiting_requests=0, generated_tokens=10, paused=False, version=0)
    assert p.observe(busy) == 0.0
    time.sleep(0.2)
    assert p.observe(busy) >= 0.2  # work, and no token since
    assert p.observe(dict(busy, generated_tokens=11)) == 0.0  # a token: progress
    time.sleep(0.1)
    assert p.observe(dict(busy, generated_tokens=11, paused=True)) == 0.0  # paused (a weight update): not a stall
    time.sleep(0.1)
    assert p.observe(dict(busy, generated_tokens=11, running_requests=0)) == 0.0  # idle
    first = EngineProgress()
    first.observe(dict(busy, generated_tokens=0))
    time.sleep(0.1)
    assert first.observe(dict(busy, generated_tokens=0)) == 0.0  # before its first token (a first decode may compile)


# ------------------------------------------------------------------------------------------ background failures
def test_a_reported_background_failure_makes_the_worker_dead_with_the_reason():
    from realhf.base.run_secret import new_run_secret
    from realhf.system.transport.heartbeat import HeartbeatMonitor, HeartbeatSender

    secret = new_run_secret()
    with HeartbeatMonitor(secret) as mon:
        a = HeartbeatSender("model_worker_0", secret, mon.address, interval=0.1)
        b = HeartbeatSender("model_worker_1", secret, mon.address, interval=0.1)
        a.start()
        b.start()
        try:
            t0 = time.monotonic()
            while mon.last_seen("model_worker_0") is None or mon.last_seen("model_worker_1") is None:
                assert time.monotonic() - t0 < 10
                time.sleep(0.05)
            assert mon.dead_workers(["model_worker_0", "model_worker_1"], 5.0) == []
            a.report_failure("publishing version 3 failed: disk full")
            t0 = time.monotonic()
            while not mon.dead_workers(["model_worker_1"], 5.0):
                assert time.monotonic() - t0 < 5, "a reported failure never reached the monitor"
                time.sleep(0.02)
            # reported by a worker the caller does not wait for: it still ends the wait
            assert mon.dead_workers(["model_worker_1"], 5.0) == ["model_worker_0"]
            assert "publishing version 3 failed: disk full" in mon.describe("model_worker_0", 5.0)
            assert mon.failure("model_worker_1") is None and mon.n_rejected == 0
        finally:
            a.stop()
            b.stop()


def test_a_failed_publish_behind_training_is_reported_at_once(tmp_path):
    import threading
    import types

    import torch

    from realhf.api.core.system_api import GenServersSpec
    from realhf.base.topology import single_process_grid
    from realhf.system.trainer.served import WeightPublisher
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.tiny import ensure_tiny_model

    module = build_from_hf(ensure_tiny_model("qwen2", tie_word_embeddings=True), grid=single_process_grid(),
                           dtype=torch.float32)
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] = float("nan")
    model = types.SimpleNamespace(module=module, grid=module.grid)
    spec = types.SimpleNamespace(save_dir=str(tmp_path), rollout=object(), experiment_name="e", trial_name="t")
    got, reported = [], threading.Event()
    pub = WeightPublisher(spec, GenServersSpec(backend="gen", n_servers=1), b"s" * 32, None, None, "actor@1",
                          on_failure=lambda msg: (got.append(msg), reported.set()))
    pub.publish(model, 4)  # returns at once: the write runs behind
    assert reported.wait(30), "the failed publish was not reported"
    (msg,) = got
    assert "version 4" in msg and os.path.join(str(tmp_path), ".gen_weights", "actor@1") in msg, msg
    assert "not finite" in msg, msg
    with pytest.raises(RuntimeError, match="version 4"):  # and raised again by the next publish
        pub.publish(model, 5)


# ------------------------------------------------------------------------------------------ end to end
def _async_args(model, d, exp, *extra):
    return ["async-ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=2", "ppo.gen.max_new_tokens=4", "ppo.ppo_n_minibatches=1", "use_chat_template=false",
            "prompt_template={prompt}", "reward_allow_last_number=true", "use_critic=false", "ppo.kl_ctl=0",
            "exp_ctrl.benchmark_steps=50", "exp_ctrl.ckpt_freq_steps=1", f"fileroot={d}", f"experiment_name={exp}",
            "n_devices_per_node=2", "allocation_mode=gen.d1m1p1+d1m1p1", "param_realloc=disk",
            "gen_server.health_timeout_secs=5", *extra]


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _wait_for_file_text(path, text, proc, timeout=240.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                if text in f.read():
                    return
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} said {text!r}"
        time.sleep(0.1)
    raise AssertionError(f"{path} did not say {text!r} within {timeout:.0f} s")


def _check_stopped_server_named(out, run_dir):
    log = os.path.join(run_dir, "logs", "gen_server_0.log")
    assert re.search(r"generation server 0 \(gen_server_0 at \S+:\d+\) runs but is not live: it answered no "
                     r"/health for [\d.]+ s \(limit gen_server.health_timeout_secs=5;", out), out[-3000:]
    assert f"its log: {log}" in out, out[-3000:]


@pytest.mark.slow
def test_a_server_stopped_at_start_stops_an_async_run_named(tiny_math_run):
    """SIGSTOP of the only server as soon as it serves: the launcher, which watches it from the moment it has started
    the run's processes, stops the run within gen_server.health_timeout_secs (5 s), naming the server, its address
    and log (today: the run waits for the server's answers for gen_server.request_timeout_secs, an hour)."""
    from realhf.testing import run_processes, start_quickstart, wait_until_gone

    model, d = tiny_math_run
    exp = "stopped-server"
    run_dir = os.path.join(str(d), exp, "trial0")
    proc = start_quickstart(_async_args(model, d, exp))
    try:
        _wait_for_file_text(os.path.join(run_dir, "logs", "gen_server_0.log"), "serving on http://", proc)
        (server,) = [p for p in run_processes(str(d)) if "realhf.gen_server.server" in " ".join(p.cmdline())
                     and exp in " ".join(p.cmdline())]
        server.send_signal(signal.SIGSTOP)
        # the launcher starts the master (and watching the servers) once the rollout manager serves
        _wait_for_file_text(os.path.join(run_dir, "logs", "master.log"), "", proc)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
    assert proc.returncode == 1, out[-3000:]
    assert took < 5 + 20, f"the run took {took:.1f} s to stop after its server was stopped"
    _check_stopped_server_named(out, run_dir)
    assert not wait_until_gone(os.path.join(str(d), exp), timeout=30), "processes left behind"


def test_a_stopped_server_stops_the_run_named_and_a_nan_checkpoint_fails_the_resume_named(tiny_math_run):
    """After a step and its recover checkpoint, SIGSTOP of the only server stops the run, named; that checkpoint, with a
    NaN written into its actor weights, fails the resumed run within 60 s naming the file (today: the resumed weights
    are refused by a publish behind training whose error waits for a next publish that never comes; the run hangs)."""
    from safetensors.torch import load_file, save_file

    from realhf.base.recover import RecoverStore
    from realhf.testing import run_processes, start_quickstart, wait_for_steps, wait_until_gone

    model, d = tiny_math_run
    exp = "liveness"
    run_dir = os.path.join(str(d), exp, "trial0")
    proc = start_quickstart(_async_args(model, d, exp))
    try:
        wait_for_steps(d, exp, 1, timeout=240, proc=proc)
        store = RecoverStore(os.path.join(run_dir, "recover"))
        t0 = time.monotonic()
        while store.latest() is None:  # the recover checkpoint of step 1
            assert time.monotonic() - t0 < 60 and proc.poll() is None, "no recover checkpoint"
            time.sleep(0.1)
        (server,) = [p for p in run_processes(str(d)) if "realhf.gen_server.server" in " ".join(p.cmdline())
                     and exp in " ".join(p.cmdline())]
        server.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
    assert proc.returncode == 1, out[-3000:]
    assert took < 5 + 25, f"the run took {took:.1f} s to stop after its server was stopped"
    _check_stopped_server_named(out, run_dir)
    assert not wait_until_gone(os.path.join(str(d), exp), timeout=30), "processes left behind"

    # the checkpoint that run left, with a NaN in its actor weights: the resumed run fails, naming the file
    ckpt = RecoverStore(os.path.join(run_dir, "recover")).latest()
    assert ckpt is not None and not ckpt["finished"]
    weights = os.path.join(ckpt["path"], "actor", "model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    t0 = time.monotonic()
    proc = start_quickstart(_async_args(model, d, exp, "recover_mode=resume"))
    try:
        out, _ = proc.communicate(timeout=180)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
    assert proc.returncode == 1, out[-3000:]
    assert took < 60, f"the resumed run took {took:.1f} s to fail"
    assert weights in out and "not finite" in out, out[-3000:]
    assert not wait_until_gone(os.path.join(str(d), exp), timeout=30), "processes left behind"
