"""A run resumes only its own recover checkpoint, reads it without unpickling code, and owns its trial folder.

Real launches of ``sft`` on the tiny model (launcher, master, model workers, gloo, ZMQ), real signals and real
files; crashes at exact moments through ``realhf.base.failpoint``.
"""
import glob
import json
import os
import shutil
import signal

import torch

from realhf.base.recover import INFO, RecoverStore
from realhf.testing import read_stats, run_quickstart, run_worker, sft_cmd, start_quickstart, wait_for_steps

def sft(setup, root, exp, *extra, trial="trial0"):
    return sft_cmd(*setup, root, exp, "model.optimizer.lr=1e-3", f"trial_name={trial}", "allocation_mode=d2m1p1",
                   "n_devices_per_node=2", *extra)


def run(args, env=None, code=0):
    p = run_quickstart(args, timeout=300, env=env)
    assert p.returncode == code, f"exit {p.returncode}, expected {code}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.stdout + p.stderr


def steps(root, exp, trial="trial0"):
    return [r["global_step"] for r in read_stats(root, exp, trial)]


def saved(root, exp, trial="trial0"):
    from safetensors.torch import load_file

    (path,) = glob.glob(os.path.join(root, exp, trial, "checkpoints", "default", "*"))
    return load_file(os.path.join(path, "model.safetensors"))


def test_a_relaunch_never_resumes_another_runs_checkpoint(tiny_sft, tmp_path):
    root = str(tmp_path)
    # run A finishes and leaves a recover checkpoint (global step 14 of 16)
    run(sft(tiny_sft, root, "x", "exp_ctrl.total_train_epochs=4", "exp_ctrl.ckpt_freq_steps=2"))
    assert RecoverStore(os.path.join(root, "x", "trial0", "recover")).latest()["global_step"] == 14
    # run B: the same trial with another learning rate, killed before its first checkpoint, auto-relaunched
    p = start_quickstart(sft(tiny_sft, root, "x", "exp_ctrl.total_train_epochs=4", "model.optimizer.lr=2e-3",
                             "recover_mode=auto"))
    wait_for_steps(root, "x", 3, proc=p)
    run_worker(os.path.join(root, "x"), 1).kill()
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    assert "relaunching" in out and "starting over" in out, out[-3000:]
    assert steps(root, "x") == list(range(1, 17)), "B must redo its own steps, not continue A's"
    (stale,) = glob.glob(os.path.join(root, "x", "trial0", "recover.stale-*"))
    assert RecoverStore(stale).latest()["global_step"] == 14, "A's checkpoint is kept aside, not lost"


def test_resume_checks_and_planted_files(tiny_sft, tmp_path):
    root = str(tmp_path)
    # one model worker: these checks are the launcher's and the resuming worker's (a data-parallel resume to the
    # parameters of an uninterrupted run: tests/e2e/test_runtime_e2e.py)
    base = ["exp_ctrl.total_train_epochs=3", "exp_ctrl.ckpt_freq_steps=2", "exp_ctrl.save_freq_epochs=3",
            "allocation_mode=d1m1p1", "n_devices_per_node=1"]
    # recover_mode=resume with nothing to resume is an error before any process starts
    out = run(sft(tiny_sft, root, "r", *base, "recover_mode=resume"), code=2)
    assert "holds no recover checkpoint" in out and not os.path.exists(os.path.join(root, "r", "trial0", "logs"))
    # the uninterrupted reference, and a run whose master is killed right after its second checkpoint (step 4)
    run(sft(tiny_sft, root, "r", *base, trial="ref"))
    run(sft(tiny_sft, root, "r", *base), env={"REALHF_FAILPOINTS": "recover.after_swap@2"}, code=1)
    ckpt = RecoverStore(os.path.join(root, "r", "trial0", "recover")).latest()
    assert ckpt["global_step"] == 4 and not ckpt["finished"]
    # other options: refused, naming the option
    out = run(sft(tiny_sft, root, "r", *base, "model.optimizer.lr=5e-4", "recover_mode=resume"), code=2)
    assert "written with other options" in out and "model.optimizer.lr: 0.001 -> 0.0005" in out, out[-2000:]
    # a truncated file: refused before any process starts, naming the file
    victim = os.path.join(ckpt["path"], "default", "engine_rank0.pt")
    keep = str(tmp_path / "engine_rank0.pt")
    shutil.copy(victim, keep)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = run(sft(tiny_sft, root, "r", *base, "recover_mode=resume"), code=2)
    assert f"{victim} has" in out and "truncated" in out, out[-2000:]
    shutil.copy(keep, victim)
    # a planted pickle (with its size written into the manifest, as an attacker could): never executed
    marker = str(tmp_path / "pwned")

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    planted = os.path.join(ckpt["path"], "worker_rank0.pt")
    shutil.copy(planted, keep)
    torch.save({"rng": Evil()}, planted)
    info_path = os.path.join(ckpt["path"], INFO)
    with open(info_path) as f:
        info = json.load(f)
    info["files"]["worker_rank0.pt"] = os.path.getsize(planted)
    with open(info_path, "w") as f:
        json.dump(info, f)
    out = run(sft(tiny_sft, root, "r", *base, "recover_mode=resume"), code=1)
    assert not os.path.exists(marker), "a planted recover file ran code"
    assert f"recover file {planted} is damaged or is not a realhf recover file" in out, out[-3000:]
    assert "weights_only" not in out, out[-3000:]  # torch's advice to load it unsafely is not passed on
    # restored: the resumed run ends with the parameters of the uninterrupted one, every step once
    shutil.copy(keep, planted)
    info["files"]["worker_rank0.pt"] = os.path.getsize(planted)
    with open(info_path, "w") as f:
        json.dump(info, f)
    run(sft(tiny_sft, root, "r", *base, "recover_mode=resume"))
    assert steps(root, "r") == list(range(1, 13))
    ref, got = saved(root, "r", "ref"), saved(root, "r")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_second_launch_of_a_running_trial_fails_at_once(tiny_sft, tmp_path):
    root = str(tmp_path)
    args = sft(tiny_sft, root, "busy", "exp_ctrl.total_train_epochs=500", "exp_ctrl.ckpt_freq_steps=5")
    first = start_quickstart(args)
    try:
        wait_for_steps(root, "busy", 6, proc=first)
        out = run(args, code=2)
        assert "is in use by another launch" in out and f"pid {first.pid}" in out, out[-2000:]
        n = len(steps(root, "busy"))
        wait_for_steps(root, "busy", n + 3, proc=first)  # the first run goes on, untouched
    finally:
        first.send_signal(signal.SIGTERM)
        out1, _ = first.communicate(timeout=60)
    assert first.returncode == 130, out1[-3000:]
    done = steps(root, "busy")
    assert done == list(range(1, len(done) + 1)), "the first run's rows must be all there, in order"
    assert RecoverStore(os.path.join(root, "busy", "trial0", "recover")).latest()["global_step"] >= 5


def test_an_unwritable_fileroot_fails_before_start(tiny_sft, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run(sft(tiny_sft, str(blocker / "runs"), "w"), code=2)
    assert "fileroot=" in out and "cannot write the run folder" in out, out[-2000:]
