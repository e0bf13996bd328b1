"""What a run shows its user: the launcher's progress (a live line on a terminal, plain lines otherwise), honest
step totals, warnings once, the end-of-run summary and reward curve, and ``realhf.apps.plot`` on any run."""
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios

import pytest
from PIL import Image

from realhf.base.process import env_with_source_path, source_root
from realhf.base.progress import read_progress
from realhf.testing import read_stats, run_processes, run_quickstart, sft_cmd, start_quickstart, wait_for_steps


def _run_in_pty(args, sized=True):
    """Run the quickstart with a pseudo-terminal as stdout/stderr; its whole output, as the terminal got it.
    ``sized``: the terminal reports 40 rows x 200 columns, as a terminal window does (a pseudo-terminal that
    nobody sized, as ``script`` or a CI runner may give, reports 0 x 0)."""
    master, slave = pty.openpty()
    if sized:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "realhf.apps.quickstart", *args], cwd=source_root(),
                         env=env_with_source_path(), stdin=subprocess.DEVNULL, stdout=slave,
                         stderr=slave)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    p.wait(timeout=300)
    os.close(master)
    return p.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_progress_line_on_a_terminal(tiny_sft, tmp_path, sized):
    code, out = _run_in_pty(sft_cmd(*tiny_sft, str(tmp_path), "tty", "exp_ctrl.total_train_epochs=30",
                                    "exp_ctrl.benchmark_steps=20"), sized=sized)
    assert code == 0, out[-3000:]
    # tqdm redraws one line with carriage returns: the last state shows every step done, the ETA and the stats
    frames = re.split(r"[\r\n]", out)
    bars = [f for f in frames if re.search(r"step \d+/20 +\d+%\|", f)]
    assert bars and re.search(r"step 20/20 +100%\|", bars[-1]), frames[-20:]
    assert "ETA" in bars[-1] and "loss" in bars[-1] and "trainDefault" in bars[-1], bars[-1]
    assert not [f for f in frames if re.search(r"step \d+/(?!20\b)\d+", f)], "a total other than the 20 steps run"
    assert "tty/trial0 finished: 20 steps" in out and "reward_curve.png" in out


def test_plain_lines_totals_and_summary_without_a_terminal(tiny_sft, tmp_path):
    root = str(tmp_path)
    # 16 rows / 4 per step = 4 steps an epoch, 3 epochs: 12 steps (the epoch count decides)
    p = run_quickstart(sft_cmd(*tiny_sft, root, "plain", "exp_ctrl.total_train_epochs=3"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 12/12 (100%)" in p.stdout and "ETA" in p.stdout, p.stdout
    assert "\r" not in p.stdout, "no terminal: no redrawn progress line"
    assert re.search(r"plain/trial0 finished: 12 steps .*\n  loss: [\d.]+ in the first quarter of steps -> [\d.]+ in "
                     r"the last", p.stdout), p.stdout
    log_dir = os.path.join(root, "plain", "trial0", "logs")
    assert Image.open(os.path.join(log_dir, "reward_curve.png")).size == (800, 600)
    prog = read_progress(log_dir)
    assert (prog["total_steps"], prog["global_step"], prog["epochs"]) == (12, 12, 3)
    assert {r["total_steps"] for r in read_stats(root, "plain")} == {12}
    master_log = open(os.path.join(log_dir, "master.log")).read()
    assert "global step 12/12 (epoch 3/3, step 4/4)" in master_log
    # quiet: nothing but warnings and errors
    q = run_quickstart(["-q"] + sft_cmd(*tiny_sft, root, "quiet", "exp_ctrl.benchmark_steps=2"), timeout=300)
    assert q.returncode == 0 and q.stdout == "" and "started master" not in q.stderr, (q.stdout, q.stderr[-2000:])


def test_totals_with_benchmark_steps_and_after_a_resume(tiny_sft, tmp_path):
    root = str(tmp_path)
    args = sft_cmd(*tiny_sft, root, "resumed", "exp_ctrl.total_train_epochs=100", "exp_ctrl.benchmark_steps=10",
               "exp_ctrl.ckpt_freq_steps=4")
    crashed = run_quickstart(args, env={"REALHF_FAILPOINTS": "recover.after_swap@1"}, timeout=300)
    assert crashed.returncode == 1  # the master was killed right after its checkpoint of step 4
    log_dir = os.path.join(root, "resumed", "trial0", "logs")
    assert read_progress(log_dir)["total_steps"] == 10, "benchmark_steps decides the total, not the 100 epochs"
    p = run_quickstart(["-v"] + args + ["recover_mode=resume"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "run started: 10 steps to do, resuming after step 4" in p.stdout, p.stdout
    lines = re.findall(r"^step (\d+)/(\d+) \|", p.stdout, re.M)  # --verbose: a line for every step
    assert [int(s) for s, _ in lines] == list(range(5, 11)) and {t for _, t in lines} == {"10"}, lines
    prog = read_progress(log_dir)
    assert (prog["first_step"], prog["global_step"], prog["total_steps"]) == (4, 10, 10)
    assert [r["global_step"] for r in read_stats(root, "resumed")] == list(range(1, 11))


def test_rl_run_warns_once_and_plots_and_plot_reads_a_running_run(tiny_math_run, tmp_path):
    model, d = tiny_math_run
    root = str(tmp_path)
    # worker_timeout_secs: the master is held stopped while the plot reads the run
    args = ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=4", "ppo.gen.max_new_tokens=3", "use_critic=false", "ppo.kl_ctl=0", "use_chat_template=false",
            "prompt_template={prompt}", "reward_allow_last_number=true", f"fileroot={root}", "experiment_name=rl",
            "exp_ctrl.benchmark_steps=6", "worker_timeout_secs=120"]
    p = start_quickstart(args)
    try:
        wait_for_steps(root, "rl", 3, proc=p)
        (master,) = [q for q in run_processes(root) if "master" in q.cmdline()]
        master.send_signal(signal.SIGSTOP)  # the run is mid-way while the plot reads it
        try:
            log_dir = os.path.join(root, "rl", "trial0", "logs")
            running = subprocess.run([sys.executable, "-m", "realhf.apps.plot", log_dir], capture_output=True,
                                     text=True, env=env_with_source_path(), timeout=120)
        finally:
            master.send_signal(signal.SIGCONT)
        assert running.returncode == 0, running.stderr
        summary = json.loads(running.stdout)
        assert 3 <= summary["steps"] < 6 and "task_reward" in summary and summary["plot"].endswith("reward_curve.png")
        assert Image.open(summary["plot"]).size == (800, 600)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    # the same run, finished: 3-token answers never end, which the console says once
    assert p.returncode == 0, out[-3000:]
    assert out.count("hit the max-new-tokens limit") == 1, out
    assert "task_reward:" in out
    assert Image.open(os.path.join(root, "rl", "trial0", "logs", "reward_curve.png")).size == (800, 600)
    assert [r["global_step"] for r in read_stats(root, "rl")] == list(range(1, 7))
