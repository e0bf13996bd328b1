"""Slurm launcher (``mode=slurm``): every worker group of a run is one Slurm job, each task one process.

The launcher submits, in the order the run starts them, one ``sbatch`` job per group: the generation servers (one
task per server, ``tp`` GPUs each), the rollout manager, the master, the model workers (one task per device slot),
the rollout workers. A group holding devices is sized from the allocation: ``--nodes`` = the nodes its device slots
span, ``--ntasks-per-node`` = the slots of a node it fills, ``--gpus-per-task`` = ``slurm.gpus_per_slot`` x the slots
a task holds, ``--cpus-per-task`` = ``cpus_per_worker`` x those slots. The generation servers and the trainer are
separate jobs, so Slurm gives them disjoint GPUs. Partition, account, time limit, memory, a container image
(pyxis ``--container-image``) and extra ``sbatch``/``srun`` flags come from the ``slurm.*`` options.

Each job's batch script runs one ``srun`` step; every task runs a small shell wrapper (written next to the logs,
readable only by you: it holds the run's secret) that picks its rank from ``$SLURM_PROCID``, sets ``REALHF_HOST``
to its node's address (``slurm.host_cmd``), runs the process with its output in ``<log_dir>/<job>.log``, and
records the exit code in ``<log_dir>/slurm/<job>.exit``. The launcher watches those files and ``squeue``: a task
that exits non-zero, or a job Slurm ended (cancelled, node failure, time limit) before its tasks reported, fails the
run named, and every job of the run is cancelled (``scancel``) and waited out of the queue. Ctrl-C does the same.
When Slurm itself ended the job or its step (TIMEOUT, CANCELLED, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, ...), the
failure says so with Slurm's state and reason (``scontrol show job``, read as soon as the task's exit is seen, while
slurmctld still keeps the job's record: there may be no accounting database to ask later) or slurmstepd's notice in
the job's output file, and what to do: for a time limit, the ``slurm.time`` behind it.
The launcher touches ``<log_dir>/slurm/lease`` while it lives; if it is killed outright the processes of the
jobs notice the stale lease and end (``slurm.launcher_lease_secs``), so no job trains unsupervised.

What must be shared by every node: ``fileroot`` (logs, checkpoints, the name-resolve folder the processes find each
other through, these scripts), this source tree and the Python environment (or the container image holding them).

``--dry-run`` prints every ``sbatch`` command with its batch script and task wrapper instead of submitting.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, TextIO, Tuple

from realhf.base import logging
from realhf.base.process import LEASE_ENV, LEASE_SECS_ENV
from realhf.scheduler.local import WaitMixin

logger = logging.getLogger(__name__)

RANK = "@@REALHF_RANK@@"  # stands for a task's rank in a group's command line
_ENDED_STATES = ("BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                 "TIMEOUT", "COMPLETED", "SPECIAL_EXIT", "REVOKED")
_SECRET_KEYS = ("REALHF_RUN_SECRET",)
# Job states in which Slurm itself ended a job (FAILED too, unless its reason is the tasks' own exit code), and what
# to do about each (TIMEOUT's advice names the time limit: see SlurmScheduler._advice)
_SLURM_ENDS = {
    "TIMEOUT": "",
    "CANCELLED": "someone or something ran scancel on it (you, an administrator, a script)",
    "NODE_FAIL": "a node of the job failed; recover_mode=auto relaunches the run from its last recover checkpoint",
    "PREEMPTED": "a job of higher priority took its resources; recover_mode=auto relaunches the run from its last "
                 "recover checkpoint",
    "OUT_OF_MEMORY": "a task went over the job's memory; raise slurm.mem_per_slot",
    "DEADLINE": "it reached the deadline given to sbatch (--deadline in slurm.sbatch_args)",
    "BOOT_FAIL": "a node of the job failed to boot",
    "REVOKED": "",
    "FAILED": "",
}
_OWN_FAILURE_REASONS = ("NonZeroExitCode", "None")  # a FAILED job with these reasons ended by its tasks' exit codes
# slurmstepd's notice in a job's output ("*** STEP 12.0 ON node1 CANCELLED AT 2024-01-01T10:00:00 DUE TO TIME LIMIT
# ***"), which also tells of a step Slurm ended while the job went on, and outlives the job's record
_STEPD_NOTICE = re.compile(r"\*\*\* ((?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+[^*\n]*?) \*\*\*")
_NOTICE_STATES = {"TIME LIMIT": "TIMEOUT", "PREEMPTION": "PREEMPTED", "NODE FAILURE": "NODE_FAIL"}
_SETTLE_SECS = 15.0  # how long a failed task's report waits for its ending job's final state (COMPLETING -> ...)


class SlurmError(ValueError):
    """A Slurm command failed or Slurm cannot run the job; the message says what to do."""


@dataclasses.dataclass
class SlurmTask:
    name: str
    job_id: str
    rank: int
    log_path: str
    exit_path: str


@dataclasses.dataclass
class GroupShape:
    """How a group asks Slurm for its resources."""

    ntasks: int
    nodes: Optional[int]  # None: anywhere (CPU-only groups)
    ntasks_per_node: Optional[int]
    cpus_per_task: int
    gpus_per_task: int


def group_shape(n: int, worker: bool, slots: int, config) -> GroupShape:
    """The shape of a group of ``n`` tasks of ``slots`` device slots each (``worker``: they hold devices)."""
    if not worker:
        return GroupShape(n, None, None, 1, 0)
    per_node = config.n_devices_per_node
    if slots > per_node:
        raise SlurmError(f"a job holding {slots} device slots does not fit a node of n_devices_per_node={per_node}; "
                         "a generation server's tensor-parallel size must fit one node")
    tasks_per_node = per_node // slots
    nodes = math.ceil(n / tasks_per_node)
    return GroupShape(n, nodes, min(n, tasks_per_node), config.cpus_per_worker * slots,
                      config.slurm.gpus_per_slot * slots)  # config.slurm.gpus_per_slot: GPUs per device slot


def _shell_word(arg: str) -> str:
    """``arg`` quoted for bash, with the rank placeholder expanded to ``$RANK``."""
    parts = arg.split(RANK)
    return '"$RANK"'.join(shlex.quote(p) if p else "" for p in parts) or "''"


def _quoted_cmd(cmd: List[str]) -> str:
    return " ".join(_shell_word(a) for a in cmd)


def _mem_per_cpu(mem_per_slot: str, cpus_per_slot: int) -> str:
    units = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    num, unit = mem_per_slot.rstrip("KMGT"), mem_per_slot[len(mem_per_slot.rstrip("KMGT")):]
    return f"{max(1, int(int(num) * units[unit] / cpus_per_slot))}M"


class SlurmScheduler(WaitMixin):
    def __init__(self, log_dir: str, config, n_slots: int = 0, dry_run: bool = False, out: Optional[TextIO] = None):
        self.log_dir, self.config = log_dir, config
        self.dry_run, self.out = dry_run, out or sys.stdout
        self.script_dir = os.path.join(log_dir, "slurm")
        self.jobs: Dict[str, SlurmTask] = {}
        self.job_ids: List[str] = []
        self._job_of_group: Dict[str, str] = {}
        self._states: Dict[str, str] = {}
        self._states_t = 0.0
        self._states_at = 0.0  # when the queue was last read whole (0: never)
        self._gone_since: Dict[str, float] = {}
        # job -> why it failed when Slurm ended it, or why it counts as failed without an exit code (read by
        # WaitMixin.wait as the failure's reason)
        self.lost: Dict[str, str] = {}
        self._ending: Dict[str, Tuple[float, float]] = {}  # job -> (first seen, last asked) while its Slurm job ends
        self._explained: set = set()  # jobs whose non-zero exit code was checked against Slurm's state
        self._pending_logged: Dict[str, float] = {}
        self._stop = threading.Event()
        self.lease = os.path.join(self.script_dir, "lease")
        if not dry_run:
            os.makedirs(self.script_dir, mode=0o700, exist_ok=True)
            os.chmod(self.script_dir, 0o700)
            self._touch_lease()
            threading.Thread(target=self._keep_lease, daemon=True, name="slurm-lease").start()

    # ------------------------------------------------------------------ lease
    def _touch_lease(self):
        with open(self.lease, "a"):
            pass
        os.utime(self.lease, None)

    def _keep_lease(self):
        while not self._stop.wait(min(10.0, self.config.slurm.launcher_lease_secs / 4)):
            try:
                self._touch_lease()
            except OSError as e:
                logger.warning(f"cannot touch the launcher lease {self.lease}: {e}")

    # ------------------------------------------------------------------ submitting
    def submit(self, name: str, cmd: List[str], env: Optional[dict] = None, worker: bool = True,
               slots: int = 1, first_slot: Optional[int] = None) -> SlurmTask:
        self.submit_group([name], lambda rank: cmd, env, worker=worker, slots=slots, first_slot=first_slot)
        return self.jobs[name]

    def submit_group(self, names: List[str], cmd_for: Callable[[str], List[str]], env: Optional[dict] = None,
                     worker: bool = True, slots: int = 1, first_slot: Optional[int] = None,
                     env_for: Optional[Callable[[int], dict]] = None) -> None:
        """One Slurm job for ``names`` (task ``k`` runs ``cmd_for(str(k))``). ``env_for`` is not used: each task
        sees only the GPUs Slurm gave it (``--gpus-per-task``)."""
        group = _group_name(names)
        shape = group_shape(len(names), worker, slots, self.config)
        task_sh, batch_sh = self._task_script(names, cmd_for(RANK), env or {}), self._batch_script(group, shape)
        task_path = os.path.join(self.script_dir, f"{group}.task.sh")
        batch_path = os.path.join(self.script_dir, f"{group}.sbatch")
        argv = self._sbatch_argv(group, shape, batch_path)
        if self.dry_run:
            self._print_plan(group, names, argv, batch_path, batch_sh, task_path, task_sh)
            for k, name in enumerate(names):
                self.jobs[name] = SlurmTask(name, "(dry-run)", k, os.path.join(self.log_dir, f"{name}.log"), "")
            return
        for path, text, mode in ((task_path, task_sh, 0o700), (batch_path, batch_sh, 0o700)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        for name in names:  # an exit file of an earlier launch must not count
            for p in (self._exit_path(name), self._exit_path(name) + ".tmp"):
                if os.path.exists(p):
                    os.remove(p)
        job_id = self._sbatch(argv, group)
        self.job_ids.append(job_id)
        self._job_of_group[group] = job_id
        for k, name in enumerate(names):
            self.jobs[name] = SlurmTask(name, job_id, k, os.path.join(self.log_dir, f"{name}.log"), self._exit_path(name))
        logger.info(f"submitted {group} as Slurm job {job_id}: {len(names)} task(s)"
                    + (f" on {shape.nodes} node(s), {shape.gpus_per_task} GPU(s) and {shape.cpus_per_task} CPU(s) "
                       "per task" if shape.nodes else "") + f"; logs: {os.path.join(self.log_dir, names[0])}.log ...")

    def _exit_path(self, name: str) -> str:
        return os.path.join(self.script_dir, f"{name}.exit")

    def _sbatch_argv(self, group: str, shape: GroupShape, batch_path: str) -> List[str]:
        config = self.config
        argv = ["sbatch", "--parsable", f"--job-name=realhf:{self.config.experiment_name}:{self.config.trial_name}:{group}",
                f"--output={os.path.join(self.script_dir, group + '-%j.out')}", f"--ntasks={shape.ntasks}",
                f"--cpus-per-task={shape.cpus_per_task}"]
        if shape.nodes is not None:
            argv += [f"--nodes={shape.nodes}", f"--ntasks-per-node={shape.ntasks_per_node}"]
        if shape.gpus_per_task:
            argv.append(f"--gpus-per-task={shape.gpus_per_task}")
        if config.slurm.mem_per_slot and shape.nodes is not None:
            argv.append(f"--mem-per-cpu={_mem_per_cpu(config.slurm.mem_per_slot, config.cpus_per_worker)}")
        for flag, value in (("partition", config.slurm.partition), ("account", config.slurm.account),
                            ("time", config.slurm.time)):
            if value:
                argv.append(f"--{flag}={value}")
        return argv + shlex.split(config.slurm.sbatch_args) + [batch_path]

    def _srun_argv(self, shape: GroupShape, task_path: str) -> List[str]:
        config = self.config
        argv = ["srun", "--kill-on-bad-exit=0", f"--ntasks={shape.ntasks}", f"--cpus-per-task={shape.cpus_per_task}"]
        if shape.nodes is not None:
            argv += [f"--nodes={shape.nodes}", f"--ntasks-per-node={shape.ntasks_per_node}"]
        if shape.gpus_per_task:
            argv.append(f"--gpus-per-task={shape.gpus_per_task}")
        return argv + srun_step_args(config) + ["/bin/bash", task_path]

    def _batch_script(self, group: str, shape: GroupShape) -> str:
        srun = " ".join(shlex.quote(a) for a in self._srun_argv(shape, os.path.join(self.script_dir, f"{group}.task.sh")))
        return (f"#!/bin/bash\n# realhf run {self.config.experiment_name}/{self.config.trial_name}: job group {group}\n"
                f"exec {srun}\n")

    def _task_script(self, names: List[str], cmd: List[str], env: Dict[str, str]) -> str:
        config = self.config
        env = dict(env, **{LEASE_ENV: self.lease, LEASE_SECS_ENV: str(config.slurm.launcher_lease_secs),
                           "PYTHONUNBUFFERED": "1"})
        exports = "\n".join(f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items()))
        return f"""#!/bin/bash
# one task of a realhf run: its rank picks its job name; output to <log_dir>/<job>.log, exit code to <job>.exit
RANK="${{SLURM_PROCID:-0}}"
NAMES=({' '.join(shlex.quote(n) for n in names)})
NAME="${{NAMES[$RANK]}}"
{exports}
export REALHF_HOST="$({config.slurm.host_cmd})"
[ -n "$REALHF_HOST" ] || export REALHF_HOST="$(hostname)"
LOG={shlex.quote(self.log_dir)}/"$NAME".log
EXIT={shlex.quote(self.script_dir)}/"$NAME".exit
echo "[slurm] $NAME: job $SLURM_JOB_ID task $RANK on $(hostname) ($REALHF_HOST)" >> "$LOG"
cd {shlex.quote(os.getcwd())} 2>/dev/null || true
{_quoted_cmd(cmd)} >> "$LOG" 2>&1 < /dev/null &
CHILD=$!
trap 'kill -TERM $CHILD 2>/dev/null' TERM INT
wait $CHILD; CODE=$?
while kill -0 $CHILD 2>/dev/null; do wait $CHILD; CODE=$?; done
echo $CODE > "$EXIT.tmp" && mv -f "$EXIT.tmp" "$EXIT"
exit $CODE
"""

    def _print_plan(self, group, names, argv, batch_path, batch_sh, task_path, task_sh):
        masked = task_sh
        for line in task_sh.splitlines():
            for key in _SECRET_KEYS:
                if line.startswith(f"export {key}="):
                    masked = masked.replace(line, f"export {key}=<a fresh secret per launch>")
        w = self.out.write
        w(f"# ---- job group {group}: {len(names)} task(s): {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}\n")
        w(" ".join(shlex.quote(a) for a in argv) + "\n")
        w(f"# {batch_path}:\n{batch_sh}")
        w(f"# {task_path}:\n{masked}\n")

    def _sbatch(self, argv: List[str], group: str) -> str:
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise SlurmError("mode=slurm needs the Slurm client commands (sbatch, squeue, scancel) on PATH") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"sbatch of {group} did not answer within 120 s (is slurmctld up? sinfo)") from None
        if p.returncode != 0:
            raise SlurmError(f"sbatch of {group} failed: {p.stderr.strip() or p.stdout.strip()} "
                             f"(command: {' '.join(shlex.quote(a) for a in argv)})")
        return p.stdout.strip().split(";")[0]

    # ------------------------------------------------------------------ watching
    def _refresh_states(self, every: float = 2.0):
        if time.monotonic() - self._states_t < every or not self.job_ids:
            return
        self._states_t = t_asked = time.monotonic()
        try:
            p = subprocess.run(["squeue", "-h", "-j", ",".join(self.job_ids), "-o", "%i %T %r"], capture_output=True,
                               text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning(f"squeue failed: {e}; retrying")
            return
        if p.returncode != 0 and "Invalid job id" not in p.stderr:
            logger.warning(f"squeue failed: {p.stderr.strip()}; retrying")
            return
        states = {}
        for line in p.stdout.splitlines():
            parts = line.split(None, 2)
            if len(parts) >= 2:
                states[parts[0]] = parts[1]
                if parts[1] == "PENDING":
                    self._log_pending(parts[0], parts[2] if len(parts) > 2 else "")
        self._states, self._states_at = states, t_asked  # a queue seen whole at t_asked (failed calls keep the old)

    def _log_pending(self, job_id: str, reason: str):
        now = time.monotonic()
        first = self._pending_logged.setdefault(job_id, now)
        if now - first > 30 and int(now - first) % 60 < 2:
            group = next((g for g, j in self._job_of_group.items() if j == job_id), job_id)
            logger.warning(f"Slurm job {job_id} ({group}) is still pending after {now - first:.0f} s: {reason} "
                           "(squeue; too many nodes, GPUs or CPUs asked? check_cluster says what the cluster has)")

    def _end_reason(self, job_id: str) -> str:
        """Why a job left the queue, in Slurm's words, for a task that could not report its exit."""
        fields = _scontrol_job(job_id)
        if not fields:
            notice = self._stepd_notice(job_id)
            return f"Slurm job {job_id} is no longer in the queue" + (f" ({notice})" if notice else "")
        head, advice = self._slurm_end(job_id, fields, always=True)
        return f"{head} before it exited" + (f": {advice}" if advice else "")

    def _slurm_end(self, job_id: str, fields: Dict[str, str], always: bool = False) -> Tuple[Optional[str], str]:
        """(``Slurm job N ended: STATE (Reason)``, what to do) when Slurm itself ended the job or one of its steps (a
        time limit, scancel, a node failure, preemption, ...); otherwise (None, "") (or, with ``always``, the state)."""
        state, reason = fields.get("JobState", "?"), fields.get("Reason", "None")
        notice = self._stepd_notice(job_id)
        by_slurm = state in _SLURM_ENDS and (state != "FAILED" or reason not in _OWN_FAILURE_REASONS)
        if by_slurm or (always and not notice):
            head = f"Slurm job {job_id} ended: {state} ({reason})"
        elif notice:  # the job went on (or failed) after Slurm ended a step of it
            state = next((st for due, st in _NOTICE_STATES.items() if f"DUE TO {due}" in notice), "CANCELLED")
            head = f"Slurm ended it (slurmstepd of job {job_id}: *** {notice} ***)"
        else:
            return None, ""
        return head, (self._advice(state, fields) if by_slurm or notice else "")

    def _advice(self, state: str, fields: Dict[str, str]) -> str:
        if state != "TIMEOUT":
            return _SLURM_ENDS.get(state, "")
        t = self.config.slurm.time
        limit = f"its time limit {fields['TimeLimit']}" if fields.get("TimeLimit") else "its time limit"
        source = f"slurm.time={t!r}" if t else "the partition's default: slurm.time is empty"
        return (f"the job reached {limit} ({source}); raise slurm.time (sbatch --time), or run with recover_mode=auto "
                "to resume from the last recover checkpoint in new jobs")

    def _stepd_notice(self, job_id: str) -> Optional[str]:
        """The last ``*** ... CANCELLED AT ... ***`` line slurmstepd wrote to the job's output file, if any."""
        group = next((g for g, j in self._job_of_group.items() if j == job_id), None)
        if group is None:
            return None
        try:
            with open(os.path.join(self.script_dir, f"{group}-{job_id}.out"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - (64 << 10)))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        found = _STEPD_NOTICE.findall(text)
        return found[-1] if found else None

    def _failed_code(self, name: str, t: SlurmTask, code: int) -> Optional[int]:
        """A task's non-zero exit ``code``, once Slurm's state tells whether Slurm ended it (then ``self.lost[name]``
        says how), or None while its job is still ending (COMPLETING) and the final state may say more. Slurm's
        record is read at once, while slurmctld still holds it (MinJobAge seconds after the end, 300 by default)."""
        if name in self._explained:
            return code
        now = time.monotonic()
        first, asked = self._ending.get(name, (now, 0.0))
        if now - asked < 1.0:
            return None
        fields = _scontrol_job(t.job_id)
        if fields.get("JobState") == "COMPLETING" and now - first < _SETTLE_SECS:
            self._ending[name] = (first, now)
            return None
        self._ending.pop(name, None)
        self._explained.add(name)
        if fields.get("JobState") == "COMPLETING" and fields.get("Reason") == "TimeLimit":
            fields["JobState"] = "TIMEOUT"  # still ending after _SETTLE_SECS; its reason already says why
        head, advice = self._slurm_end(t.job_id, fields)
        if head:
            sig = f" (killed by signal {-code})" if code < 0 else ""
            self.lost[name] = f"{name} exited with code {code}{sig} because {head}" + (f": {advice}" if advice else "")
        return code

    def _codes(self) -> Dict[str, Optional[int]]:
        self._refresh_states()
        out: Dict[str, Optional[int]] = {}
        for name, t in self.jobs.items():
            code = _read_exit(t.exit_path)
            if code is not None:
                out[name] = code if code == 0 else self._failed_code(name, t, code)
                continue
            state = self._states.get(t.job_id)
            if self._states_at and (state is None or state in _ENDED_STATES):  # Slurm ended it before the task reported
                since = self._gone_since.setdefault(t.job_id, self._states_at)
                if self._states_at - since > 5.0:  # seen gone for 5 s (the task's exit file may lag on shared disks)
                    self.lost[name] = f"{name} was lost: {self._end_reason(t.job_id)}"
                    out[name] = -1
                    continue
            elif state is not None:
                self._gone_since.pop(t.job_id, None)
            out[name] = None
        return self._slurm_ends_first(out)

    def _slurm_ends_first(self, codes: Dict[str, Optional[int]]) -> Dict[str, Optional[int]]:
        """Failures Slurm explains (a job it ended) come before the failures they cause (e.g. the master's, when a
        worker's job reached its time limit): while one is known, or a failed task's job is still ending, the others
        read as running."""
        failed = [n for n, c in codes.items() if c is not None and c != 0]
        if self._ending or any(n in self.lost for n in failed):
            for n in failed:
                if n not in self.lost:
                    codes[n] = None
        return codes

    # ------------------------------------------------------------------ stopping
    def stop_all(self, grace: float = 30.0):
        ids = list(self.job_ids)
        if ids and not self.dry_run:
            subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
            t0 = time.monotonic()
            while time.monotonic() - t0 < grace:
                p = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i"], capture_output=True, text=True,
                                   timeout=30)
                if not p.stdout.strip():
                    break
                time.sleep(0.3)
            else:
                logger.error(f"Slurm jobs {', '.join(ids)} are still in the queue {grace:.0f} s after scancel")
        self.job_ids.clear()
        self.jobs.clear()
        self._stop.set()
        if not self.dry_run:
            try:
                os.remove(self.lease)
            except OSError:
                pass


def srun_step_args(config) -> List[str]:
    """The ``srun`` flags every step of a run takes from ``slurm.*`` (also check_cluster's probe step): the container
    image (pyxis), its working folder and mounts, then ``slurm.srun_args``."""
    argv = []
    if config.slurm.container_image:
        argv += [f"--container-image={config.slurm.container_image}", f"--container-workdir={os.getcwd()}"]
        if config.slurm.container_mounts:
            argv.append(f"--container-mounts={config.slurm.container_mounts}")
    return argv + shlex.split(config.slurm.srun_args)


def sinfo(partition: str, fmt: str, timeout: float = 20.0) -> Tuple[Optional[List[str]], Optional[str]]:
    """(rows of ``sinfo -h -o fmt`` for ``partition`` (every partition when empty), whitespace collapsed, None), or
    (None, why sinfo failed)."""
    cmd = ["sinfo", "-h", "-o", fmt] + ([f"--partition={partition}"] if partition else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"sinfo did not answer within {timeout:g} s"
    except OSError as e:
        return None, f"sinfo cannot run: {e}"
    if p.returncode != 0:
        return None, f"sinfo failed: {' '.join(p.stderr.split())[-400:]}"
    return [" ".join(line.split()) for line in p.stdout.splitlines() if line.strip()], None


def _scontrol_job(job_id: str) -> Dict[str, str]:
    """The fields of ``scontrol show job -o JOB`` (JobState, Reason, TimeLimit, ...); {} when slurmctld has no record
    of the job any more (there is no accounting database to ask instead) or scontrol fails."""
    try:
        p = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning(f"scontrol show job {job_id} failed: {e}")
        return {}
    if p.returncode != 0:
        return {}
    return dict(w.split("=", 1) for w in p.stdout.split() if "=" in w)


def _read_exit(path: str) -> Optional[int]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            code = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return -(code - 128) if code > 128 else code  # 137 from the shell = killed by signal 9


def _group_name(names: List[str]) -> str:
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix(names).rstrip("0123456789")
    return (prefix.rstrip("_") or "group") + "s"


def check(config, n_slots: int) -> None:
    """Before anything starts: the Slurm client works and the partition can hold the run's biggest device group."""
    if not shutil.which("sbatch"):
        raise ValueError("mode=slurm needs the Slurm client commands (sbatch, squeue, scancel, sinfo) on PATH")
    lines, err = sinfo(config.slurm.partition, "%D|%c|%G|%P", timeout=60)
    if err:
        raise ValueError(f"mode=slurm: {err}; is slurmctld reachable (SLURM_CONF)?")
    rows = [line.split("|") for line in lines if line.count("|") == 3]
    if not rows:
        where = f"partition {config.slurm.partition!r}" if config.slurm.partition else "the default partition"
        raise ValueError(f"mode=slurm: {where} has no nodes (sinfo)")
    nodes = sum(int(r[0]) for r in rows)
    if config.n_nodes > nodes:
        raise ValueError(f"mode=slurm: the run asks for n_nodes={config.n_nodes} but the partition has {nodes} node(s)")
    need_gpus = config.slurm.gpus_per_slot * config.n_devices_per_node
    if need_gpus:
        have = max(_gres_gpus(r[2]) for r in rows)
        if have < need_gpus:
            raise ValueError(
                f"mode=slurm: a node must hold {need_gpus} GPUs (n_devices_per_node={config.n_devices_per_node} x "
                f"slurm.gpus_per_slot={config.slurm.gpus_per_slot}) but the partition's nodes have at most {have} "
                "(sinfo GRES); for a CPU-only run set slurm.gpus_per_slot=0")


def _gres_gpus(gres: str) -> int:
    """GPUs in a sinfo GRES string such as ``gpu:8``, ``gpu:a100:8(S:0-1)``, ``(null)``."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _make(log_dir: str, config, n_slots: int) -> SlurmScheduler:
    return SlurmScheduler(log_dir, config, n_slots)


def _register():
    from realhf.scheduler import Launcher, register_launcher

    register_launcher(Launcher("slurm", make=_make, check=check, remote=True, own_devices=True,
                               dry_run=lambda log_dir, config, n, out: SlurmScheduler(log_dir, config, n, True, out)))


_register()
