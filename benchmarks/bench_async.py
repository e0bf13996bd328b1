"""Asynchronous RL (``async-ppo-math``) against synchronous training (``ppo-math``) in the main job's setting: GRPO on
SmolLM2-135M-Instruct over arithmetic word problems, 4 prompts x 8 answers x at most 40 new tokens, fp32, on this
machine's CPU cores. Slow: about 25 minutes with SmolLM2 at the default 12 steps (4-7 minutes a configuration).

    python benchmarks/bench_async.py [--model smollm2|tiny] [--steps 12] [--configs colocated,split,async1,async4]
                                     [--root DIR] [--reuse] [--async-extra key=value ...] [--task add|mix]
    # a variant: a named configuration plus @key=value overrides (env.NAME=value: an environment variable)
    python benchmarks/bench_async.py --root DIR --reuse --configs colocated,split,async1@async_rl.prox_logp=behaviour

Configurations (every one through the real quickstart launcher, in a subprocess, one after another; same seed,
same training file, same prompt order, same number of steps):

* ``colocated``: ``ppo-math allocation_mode=d1m1p1 cpus_per_worker=2``: one model worker with both cores does
  everything in turn (the main job's layout, the best synchronous one here);
* ``split``: ``ppo-math allocation_mode=gen.d1m1p1+d1m1p1 n_devices_per_node=2 cpus_per_worker=1
  param_realloc=disk``: a generation server and a trainer, one core (thread) each, taking turns;
* ``async1`` / ``async4``: ``async-ppo-math`` on that same split with ``async_rl.max_head_offpolicyness`` 1 / 4
  (for 4, ``async_rl.max_concurrent_rollouts`` = 2 batches of prompts, ``--async4-concurrency``: 64 sequences,
  which the server's ``gen_server.max_num_seqs=64`` decodes as one batch, so a second batch in flight costs the
  server's single thread little extra per decode step). ``--async-extra`` adds overrides to the asynchronous runs
  only (e.g. ``async_rl.prox_logp=behaviour``).

``--reuse`` keeps every configuration already measured under ``--root`` (``results.jsonl``; its figures are
summarized again from its ``stats.jsonl``) and runs only the others, so variants can be added to one comparison.

Throughput: trained samples (prompts x answers) per hour of the steps after the first, i.e. over the wall time
from the first step's end to the last step's end = the sum of ``step_time`` of steps 2..N (a step's time runs from
the end of the previous step to its own end, nothing else happens between steps when no checkpoint is saved).
Start-up (processes, model loading) and the first batch's generation, which every layout pays once, are left out;
``samples_per_hour_all`` (all steps, first included) and ``samples_per_hour_median`` (from the median step time,
robust to a step slowed by another job on the machine) are printed beside it, and two equal-work figures:
``answer_tokens_per_hour`` (tokens generated) and ``trained_tokens_per_hour`` (tokens of the samples training kept;
with ``ppo.skip_zero_advantage`` a flat group costs no training), as runs that train different samples do different
work per sample; per-MFC times are medians over steps 2..N. While the steps after the first run,
the CPU time of every process of the run is sampled (``/proc``), so each process's share of a core says where
it waited.

Output: JSON lines; ``what=run`` (one per configuration: throughput, step times, the reward curve, first- and
last-quarter mean reward, version lag, trainer wait, server idle fraction, per-process cores used), ``what=ratio``
and ``what=waits`` (a sentence per configuration computed from the figures).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import emit  # noqa: E402

SPLIT = ["allocation_mode=gen.d1m1p1+d1m1p1", "n_devices_per_node=2", "cpus_per_worker=1", "param_realloc=disk"]
CONFIGS = {
    "colocated": ("ppo-math", ["allocation_mode=d1m1p1", "n_devices_per_node=1", "cpus_per_worker=2"]),
    "split": ("ppo-math", SPLIT),
    "async1": ("async-ppo-math", SPLIT + ["async_rl.max_head_offpolicyness=1"]),
    "async4": ("async-ppo-math", SPLIT + ["async_rl.max_head_offpolicyness=4"]),
}
PROMPTS, GROUP = 4, 8
# --task: "add" (the earlier main job: one-step additions, 4 prompts, <= 40 new tokens, the last number counts) or
# "mix" (today's main job, scripts/main_job.py: one- and two-step problems, 8 prompts, <= 128 new tokens, strict
# reward, flat groups skipped in training): (prompts a step, max new tokens, extra overrides)
TASKS = {"add": (4, 40, ["reward_allow_last_number=true"]),
         "mix": (8, 128, ["reward_allow_last_number=false", "reward_unfinished_as_wrong=true",
                          "ppo.skip_zero_advantage=true"])}


def model_path(which: str) -> str:
    if which == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="float32")
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def make_data(root: str, task: str = "add") -> str:
    """The main job's training problems (scripts/main_job.py: for "add", additions up to 30, seed 1, held-out ones
    removed; for "mix", the mix's training split, numbers up to 10, seed 1)."""
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    path = os.path.join(root, "train.jsonl")
    if task == "mix":
        from realhf.impl.dataset.arithmetic import make_mix_split

        write_math_jsonl(make_mix_split(2000, 96, seed=1, max_value=10)[0], path)
        return path
    test = {r["prompt"] for r in make_arithmetic_problems(64, seed=1001, kind="add", max_value=30)}
    train = [r for r in make_arithmetic_problems(2064, seed=1, kind="add", max_value=30) if r["prompt"] not in test][:2000]
    write_math_jsonl(train, path)
    return path


def common_overrides(model: str, data: str, steps: int, root: str, tiny: bool, task: str = "add"):
    """The main job's GRPO options (scripts/main_job.py), with a fixed seed and no checkpoints."""
    _, max_new, task_ov = TASKS[task]
    out = [f"actor.path={model}", f"dataset.path={data}", f"fileroot={root}", "seed=1", "use_critic=false",
           "ppo.kl_ctl=0", f"group_size={GROUP}", f"dataset.train_bs_n_seqs={PROMPTS}", "dataset.max_prompt_len=128",
           "prompt_template={prompt}", *task_ov, "use_chat_template=true",
           f"ppo.gen.max_new_tokens={max_new}", "ppo.gen.temperature=0.7", "ppo.ppo_n_minibatches=2", "ppo.adv_norm=false",
           "ppo.group_adv_norm=true", "ppo.eps_clip=0.2", "actor.optimizer.lr=3e-5",
           "actor.optimizer.gradient_clipping=1.0", "actor.optimizer.weight_decay=0.0",
           f"exp_ctrl.benchmark_steps={steps}", "exp_ctrl.save_freq_steps=1000000", "-q"]
    if tiny:  # the tiny test model has no chat template and learns at a larger rate
        repl = {"use_chat_template": "false", "actor.optimizer.lr": "1e-3"}
        out = [f"{o.split('=', 1)[0]}={repl[o.split('=', 1)[0]]}" if o.split("=", 1)[0] in repl else o for o in out]
    return out


# ---------------------------------------------------------------------------------------------- process CPU sampling
def _role(p) -> str:
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001  (psutil's NoSuchProcess/AccessDenied: the process is gone)
        return ""
    if "--role" in cmd:
        i = cmd.index("--role")
        return cmd[i + 1] + (f"_{cmd[cmd.index('--rank') + 1]}" if "--rank" in cmd else "")
    if any(c.startswith("realhf.gen_server") for c in cmd):
        return "gen_server" + (f"_{cmd[cmd.index('--index') + 1]}" if "--index" in cmd else "")
    return ""


class CpuSampler:
    """CPU seconds (user + system) of every process under ``root_pid``, summed by role. A helper process (e.g. a
    grading pool) counts for its nearest ancestor that has a role; the launcher itself is ``launcher``. A process
    that ended keeps the last CPU time seen, so sums never go down."""

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.roles, self.cpu = {}, {}

    def sample(self) -> dict:
        import psutil

        try:
            top = psutil.Process(self.root_pid)
            procs = [top] + top.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            if p.pid not in self.roles:
                r = _role(p)
                if not r:
                    try:
                        anc = p.parent()
                        while anc is not None and anc.pid not in self.roles and anc.pid != self.root_pid:
                            anc = anc.parent()
                        r = self.roles.get(anc.pid, "launcher") if anc is not None else "launcher"
                    except psutil.NoSuchProcess:
                        r = "launcher"
                self.roles[p.pid] = r
            try:
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        out = {}
        for pid, c in self.cpu.items():
            out[self.roles[pid]] = out.get(self.roles[pid], 0.0) + c
        return out


class StepWatcher(threading.Thread):
    """Takes a CPU snapshot of the run's processes when ``stats.jsonl`` first has 1 row and again when it has
    ``steps`` rows (polling every 0.5 s; a snapshot is the last sample before the row appeared, so it is at most
    0.5 s old; the workers are still alive at the last row)."""

    def __init__(self, pid: int, stats_path: str, steps: int):
        super().__init__(daemon=True)
        self.sampler, self.path, self.steps = CpuSampler(pid), stats_path, steps
        self.snaps = {}
        self.stop = threading.Event()

    def _rows(self) -> int:
        try:
            with open(self.path) as f:
                return sum(1 for line in f if line.strip())
        except OSError:
            return 0

    def run(self):
        last = None
        while not self.stop.is_set():
            n = self._rows()
            if n >= 1 and 1 not in self.snaps and last is not None:
                self.snaps[1] = last
            if n >= self.steps and last is not None:
                self.snaps[self.steps] = last
                return
            last = (time.monotonic(), self.sampler.sample())
            self.stop.wait(0.5)


# ---------------------------------------------------------------------------------------------- one configuration
def run_config(name: str, exp: str, overrides, base, root: str, steps: int, env=None):
    from realhf.base.process import env_with_source_path, source_root

    exp_name = f"bench-async-{name}"
    log_dir = os.path.join(root, exp_name, "trial0", "logs")
    stats_path = os.path.join(log_dir, "stats.jsonl")
    if os.path.exists(stats_path):
        os.remove(stats_path)
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", exp, *base, *overrides, f"experiment_name={exp_name}"]
    out_path = os.path.join(root, f"{exp_name}.out")
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        p = subprocess.Popen(cmd, cwd=source_root(), env={**env_with_source_path(), **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
        watcher = StepWatcher(p.pid, stats_path, steps)
        watcher.start()
        rc = p.wait()
        watcher.stop.set()
        watcher.join()
    wall = time.monotonic() - t0
    if rc != 0:
        with open(out_path) as f:
            raise RuntimeError(f"{name} failed with exit code {rc}; the end of its output ({out_path}):\n" + f.read()[-4000:])
    with open(stats_path) as f:
        rows = [r for r in (json.loads(line) for line in f if line.strip()) if "step_time" in r]
    cores = {}
    if 1 in watcher.snaps and steps in watcher.snaps:
        (ta, a), (tb, b) = watcher.snaps[1], watcher.snaps[steps]
        cores = {r: round((b.get(r, 0.0) - a.get(r, 0.0)) / (tb - ta), 2) for r in sorted(b) if tb > ta}
    res = summarize(name, exp, overrides, rows, wall, cores)
    if env:
        res["env"] = env
    return res


def _median(rows, key):
    """Median of ``key`` over steps 2..N (robust to a step slowed by another job on the machine)."""
    vals = [r[key] for r in (rows[1:] if len(rows) > 1 else rows) if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 3) if vals else None


def summarize(name, exp, overrides, rows, wall, cores):
    n = len(rows)
    st = [r["step_time"] for r in rows]
    per_step = PROMPTS * GROUP
    steady = sum(st[1:]) if n > 1 else sum(st)
    rewards = [round(r["task_reward"], 3) for r in rows]
    k = max(1, n // 4)
    res = {
        "what": "run", "config": name, "experiment": exp,
        "overrides": [o for o in overrides if not o.startswith(("allocation_mode", "n_devices", "param_realloc"))],
        "allocation": next(o.split("=", 1)[1] for o in overrides if o.startswith("allocation_mode=")),
        "steps": n, "samples_per_step": per_step,
        "samples_per_hour": round(per_step * max(n - 1, 1) / steady * 3600, 1),
        "samples_per_hour_all": round(per_step * n / sum(st) * 3600, 1),
        "samples_per_hour_median": round(per_step / statistics.median(st[1:] or st) * 3600, 1),
        "step_time_mean": round(statistics.fmean(st[1:] or st), 2), "step_time_median": round(statistics.median(st[1:] or st), 2),
        "first_step_time": round(st[0], 2), "launch_wall_s": round(wall, 1),
        "reward_curve": rewards,
        "reward_first_quarter": round(statistics.fmean(rewards[:k]), 3),
        "reward_last_quarter": round(statistics.fmean(rewards[-k:]), 3),
        "reward_mean": round(statistics.fmean(rewards), 3),
    }
    # Equal-work figures over the same steps: the work of a sample differs between runs (its answer's length, and
    # whether training keeps its group, which ppo.skip_zero_advantage decides from the rewards), so samples per hour
    # alone compares runs that did different work. Answer tokens generated, and tokens of the samples trained (a
    # step's tokens times its kept fraction), per hour.
    later = rows[1:] if n > 1 else rows
    res["answer_tokens_per_hour"] = round(sum(r.get("n_valid_tokens", 0) for r in later) / steady * 3600)
    res["trained_tokens_per_hour"] = round(sum(r.get("n_tokens", 0) * r.get("actor_kept_frac", 1.0) for r in later)
                                           / steady * 3600)
    for key in ("actor_gen/time", "rew_inf/time", "actor_inf/time", "actor_train/time", "actor_train/weight_sync_time",
                "actor_gen/weight_sync_time", "async/trainer_wait_time", "async/idle_fraction"):
        v = _median(rows, key)
        if v is not None:
            res[key] = v
    lags = [r["version_lag_max"] for r in rows if "version_lag_max" in r]
    if lags:  # over all steps: the first one's lag is 0 by construction
        res["version_lag_max"] = max(lags)
        res["version_lag_mean"] = round(statistics.fmean(r["version_lag_mean"] for r in rows), 3)
    res["cores_used"] = cores  # CPU seconds per wall second of each process over steps 2..N
    return res


def _ratio(r, b, key):
    return round(r[key] / b[key], 3) if r.get(key) and b.get(key) else None


def waits(r) -> str:
    """Where each process of a run waited, from its figures (medians over steps 2..N; CPU shares over those steps)."""
    st = r["step_time_median"]
    gen, train = r.get("actor_gen/time", 0.0), r.get("actor_train/time", 0.0)
    inf, rew = r.get("actor_inf/time", 0.0), r.get("rew_inf/time", 0.0)
    sync = r.get("actor_train/weight_sync_time", r.get("actor_gen/weight_sync_time", 0.0))
    cores = r.get("cores_used", {})
    busy = sum(cores.values())
    c = (", ".join(f"{k} {v:.2f}" for k, v in cores.items() if v >= 0.02) + f"; {busy:.2f} of {os.cpu_count()} in all"
         if cores else "not sampled: steps shorter than the 0.5 s sampling period")
    if r["experiment"] == "ppo-math" and r["allocation"] == "d1m1p1":
        return (f"one process does everything in turn with all its threads: generation {gen:.1f} s ({gen / st:.0%}) then "
                f"training {train:.1f} s ({train / st:.0%}) of a {st:.1f} s step; no process waits for another "
                f"(cores used: {c})")
    if r["experiment"] == "ppo-math":
        return (f"the trainer waits for the server while it generates ({gen:.1f} s = {gen / st:.0%} of a {st:.1f} s "
                f"step; grading {rew:.2f} s) and the server waits while the trainer trains ({train:.1f} s) and syncs "
                f"weights ({sync:.2f} s): the server is idle {max(0.0, 1 - gen / st):.0%} of the step "
                f"(cores used: {c})")
    wait, idle = r.get("async/trainer_wait_time", 0.0), r.get("async/idle_fraction")
    idle_s = f"{idle:.0%}" if idle is not None else "?"
    return (f"the trainer waits for trajectories {wait:.1f} s of a {st:.1f} s step ({wait / st:.0%}); it spends "
            f"{inf:.1f} s recomputing log-probs, {train:.1f} s training and {sync:.2f} s publishing weights; the "
            f"generation server is idle {idle_s} of the time (no episode running); version lag mean "
            f"{r.get('version_lag_mean', 0):.2f}, max {r.get('version_lag_max', 0):.0f} (cores used: {c})")


def parse_config(spec: str, a):
    """``name`` or ``name@key=value@key=value`` (a named configuration plus overrides of this run only;
    ``env.NAME=value`` sets an environment variable of the run's processes instead). Returns (experiment,
    overrides, environment)."""
    name, *extra = spec.split("@")
    env = dict(e[4:].split("=", 1) for e in extra if e.startswith("env."))
    extra = [e for e in extra if not e.startswith("env.")]
    if name not in CONFIGS:
        raise SystemExit(f"--configs: unknown configuration {name!r}; choose from {sorted(CONFIGS)} (plus @key=value)")
    exp, ov = CONFIGS[name]
    ov = list(ov)
    if name == "async4":
        ov.append(f"async_rl.max_concurrent_rollouts={a.async4_concurrency}")
    if exp == "async-ppo-math":
        ov += a.async_extra
    # a later key=value replaces an earlier one with the same key
    keys = [o.split("=", 1)[0] for o in extra]
    ov = [o for o in ov if o.split("=", 1)[0] not in keys] + extra
    return exp, ov, env


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", default="colocated,split,async1,async4",
                    help="comma-separated: colocated, split, async1, async4, each optionally followed by @key=value "
                         "overrides, e.g. async1@async_rl.prox_logp=behaviour")
    ap.add_argument("--root", default=None, help="fileroot of the runs (default: a new temporary folder)")
    ap.add_argument("--reuse", action="store_true",
                    help="take the result of a configuration already measured under --root (results.jsonl, same "
                         "model and steps) instead of running it again")
    ap.add_argument("--task", default="add", choices=sorted(TASKS),
                    help="add: the earlier main job (4 prompts, <= 40 tokens); mix: today's (8 prompts, <= 128 tokens, "
                         "strict reward, flat groups skipped)")
    ap.add_argument("--async4-concurrency", type=int, default=None,
                    help="async_rl.max_concurrent_rollouts of async4 (episodes = prompts in flight)")
    ap.add_argument("--async-extra", nargs="*", default=[], help="key=value overrides of the asynchronous runs only")
    a = ap.parse_args()
    global PROMPTS
    PROMPTS = TASKS[a.task][0]
    a.async4_concurrency = a.async4_concurrency or 2 * PROMPTS
    assert a.steps >= 3, "--steps must be at least 3 (the first step is left out of the throughput)"
    root = a.root or tempfile.mkdtemp(prefix="bench-async-")
    os.makedirs(root, exist_ok=True)
    model = model_path(a.model)
    data = make_data(root, a.task)
    base = common_overrides(model, data, a.steps, root, a.model == "tiny", a.task)
    emit(what="setup", model=a.model, task=a.task, steps=a.steps, prompts=PROMPTS, group_size=GROUP,
         max_new_tokens=TASKS[a.task][1],
         root=root, cpu_count=os.cpu_count(), loadavg=[round(x, 2) for x in os.getloadavg()])
    done_path = os.path.join(root, "results.jsonl")
    done = {}
    if a.reuse and os.path.exists(done_path):
        with open(done_path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("model") == a.model and r.get("steps") == a.steps and r.get("task", "add") == a.task:
                    done[r["config"]] = r
    results = {}
    for spec in [c for c in a.configs.split(",") if c]:
        exp, ov, env = parse_config(spec, a)
        tag = spec.split("@")[0] + (f"-v{zlib.crc32(spec.encode()) % 10 ** 6}" if "@" in spec else "")
        if spec in done:  # summarized again from its stats.jsonl (this version of the figures), CPU shares as measured
            old = done[spec]
            with open(os.path.join(root, f"bench-async-{tag}", "trial0", "logs", "stats.jsonl")) as f:
                rows = [x for x in (json.loads(line) for line in f if line.strip()) if "step_time" in x]
            r = summarize(tag, exp, ov, rows, old["launch_wall_s"], old["cores_used"])
            r.update({k: old[k] for k in ("env", "loadavg_after") if k in old}, config=spec, model=a.model)
        else:
            r = run_config(tag, exp, ov, base, root, a.steps, env)
            r.update(config=spec, model=a.model, task=a.task, loadavg_after=[round(x, 2) for x in os.getloadavg()])
            with open(done_path, "a") as f:
                f.write(json.dumps(r) + "\n")
        results[spec] = r
        emit(**r)
    for spec, r in results.items():
        emit(what="waits", config=spec, text=waits(r))
    for spec, r in results.items():
        if r["experiment"] != "async-ppo-math":
            continue
        for ref, goal in (("split", 1.5), ("colocated", 1.15)):
            if ref in results:
                b = results[ref]
                ratio = r["samples_per_hour"] / b["samples_per_hour"]
                emit(what="ratio", config=spec, versus=ref, throughput=round(ratio, 3),
                     throughput_median_step=round(r["samples_per_hour_median"] / b["samples_per_hour_median"], 3),
                     throughput_all_steps=round(r["samples_per_hour_all"] / b["samples_per_hour_all"], 3),
                     trained_tokens=_ratio(r, b, "trained_tokens_per_hour"),
                     answer_tokens=_ratio(r, b, "answer_tokens_per_hour"),
                     reward_last_quarter=[r["reward_last_quarter"], b["reward_last_quarter"]],
                     reward_mean=[r["reward_mean"], b["reward_mean"]], goal=goal, goal_met=ratio >= goal)


if __name__ == "__main__":
    main()
