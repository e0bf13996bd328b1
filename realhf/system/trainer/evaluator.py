"""The evaluator that scores saved checkpoints during training (``auto_eval``; see
``realhf/api/quickstart/eval_config.py``).

The master calls :meth:`AutoEvaluator.on_save` after each HF save. Each checkpoint becomes a job;
jobs run one at a time, in order, each in its own subprocess (``python -m realhf.system.trainer.evaluator
JOB.json``), which calls ``realhf.evaluation.runner.evaluate_checkpoint`` and writes its metrics to a result
file. The subprocess ends itself when the master dies (``exit_when_parent_dies``) and stays in the
master's process group, so the launcher's stop reaches it; training is never blocked by it and a
failure there (an exception, a crash, a timeout) is reported — in the master's log with the tail of
the evaluation's log, and as ``auto_eval/failed`` in ``stats.jsonl`` — but never stops training.

When a job finishes, ``<dataset>/<metric>`` (e.g. ``gsm8k/greedy_acc``, ``gsm8k/sample_pass@1``;
accuracies as fractions) is logged for the checkpoint's global step with
:meth:`StatsLogger.log_past`, i.e. one extra row ``{"global_step": step, ...}`` in ``stats.jsonl`` and
scalars at that step in TensorBoard. At the end of training :meth:`AutoEvaluator.wait` waits for the
queued jobs (``final_wait_secs``) and stops what is left.

Outputs: ``<output_dir>/<checkpoint tag>/`` holds the evaluation's per-problem jsonl files,
``aggregate.json``, ``table.txt``, ``job.json``, ``result.json`` and ``eval.log``.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, Dict, List, Optional

from realhf.base import logging
from realhf.base.process import env_with_source_path, exit_when_parent_dies, source_root, tail

logger = logging.getLogger(__name__)


def policy_model(spec):
    """The model whose checkpoints are evaluated: the trained policy (``actor``, else the first trained
    model that is not a critic)."""
    trained = [m for m in spec.models if m.optimizer is not None and not m.is_critic]
    for m in trained:
        if m.name == "actor":
            return m
    return trained[0] if trained else None


def flatten_metrics(metrics: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """``{dataset: {metric: v}}`` -> ``{"dataset/metric": v}`` (numbers only)."""
    out = {}
    for ds, m in metrics.items():
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{ds}/{k}"] = float(v)
    return out


@dataclasses.dataclass
class EvalJob:
    model_path: str
    global_step: int
    tag: str
    out_dir: str

    @property
    def log_path(self) -> str:
        return os.path.join(self.out_dir, "eval.log")

    @property
    def result_path(self) -> str:
        return os.path.join(self.out_dir, "result.json")


class AutoEvaluator:
    """Runs evaluation jobs one at a time in subprocesses and logs their metrics through ``stats``
    (an object with ``log_past(step, stats)``).

    ``cfg`` is an :class:`~realhf.api.quickstart.eval_config.EvaluatorConfig`; ``cmd`` (tests) replaces
    the evaluation command; ``env`` adds environment variables to the subprocess."""

    def __init__(self, cfg, stats, output_dir: str, cmd: Optional[List[str]] = None, env: Optional[dict] = None):
        self.cfg = cfg
        self.stats = stats
        self.output_dir = os.path.abspath(os.path.expanduser(output_dir))
        self.cmd = cmd or [sys.executable, "-m", "realhf.system.trainer.evaluator"]
        self.extra_env = dict(env or {})
        self._queue: Deque[EvalJob] = collections.deque()
        self._cv = threading.Condition()
        self._running: Optional[EvalJob] = None
        self._proc: Optional[subprocess.Popen] = None
        self._closed = False
        self._close_reason = ""
        self._thread: Optional[threading.Thread] = None
        self.results: Dict[int, dict] = {}  # global step -> {"metrics": {...}} or {"error": str}

    # ------------------------------------------------------------------ master side
    def submit(self, model_path: str, global_step: int, tag: Optional[str] = None) -> EvalJob:
        """Queue an evaluation of ``model_path`` (saved at ``global_step``); returns at once."""
        tag = tag or f"globalstep{global_step}"
        job = EvalJob(os.path.abspath(model_path), int(global_step), tag, os.path.join(self.output_dir, tag))
        with self._cv:
            if self._closed:
                raise RuntimeError("the evaluator is closed")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="auto-eval")
                self._thread.start()
            self._cv.notify_all()
        logger.info(f"auto_eval: queued {job.model_path} (global step {job.global_step}); "
                    f"{self.pending()} evaluation(s) pending")
        return job

    def on_save(self, spec, tag: str, global_step: int) -> Optional[EvalJob]:
        """The master's hook after saving checkpoint ``tag``: evaluate the policy's checkpoint."""
        m = policy_model(spec)
        if m is None:
            logger.warning("auto_eval: no trained language model to evaluate")
            return None
        return self.submit(os.path.join(spec.save_dir, m.name, tag), global_step, tag)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + (self._running is not None)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued evaluation has finished; after ``timeout`` seconds stop the rest
        (reported as failed). True when all finished in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        n = self.pending()
        if n:
            logger.info(f"auto_eval: waiting for {n} evaluation(s) (at most "
                        f"{'unlimited' if timeout is None else f'{timeout:.0f} s'})")
        with self._cv:
            while self._queue or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(timeout=1.0 if left is None else min(1.0, left))
            done = not self._queue and self._running is None
        if not done:
            logger.error(f"auto_eval: evaluations still pending after {timeout:.0f} s; stopping them")
            self.close(reason=f"not finished within auto_eval.final_wait_secs={timeout:.0f}")
        return done

    def close(self, reason: str = "evaluator closed"):
        """Stop the running evaluation and drop the queued ones (each reported as failed)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._close_reason = reason
            dropped = list(self._queue)
            self._queue.clear()
            proc = self._proc
            self._cv.notify_all()
        for job in dropped:
            self._report_failure(job, f"not run: {reason}")
        if proc is not None:
            self._stop(proc)
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker thread
    def _loop(self):
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running = job
            try:
                self._run(job)
            except BaseException as e:  # never let the thread die silently
                logger.exception("auto_eval: internal error")
                self._report_failure(job, f"internal error: {e!r}")
            finally:
                with self._cv:
                    self._running = None
                    self._proc = None
                    self._cv.notify_all()

    def _run(self, job: EvalJob):
        os.makedirs(job.out_dir, exist_ok=True)
        if os.path.exists(job.result_path):
            os.unlink(job.result_path)  # a result of an earlier attempt must not be trusted
        spec = {"model_path": job.model_path, "output_path": job.out_dir, "data_names": list(self.cfg.data_names),
                "options": self.cfg.eval_kwargs(), "result_path": job.result_path, "global_step": job.global_step}
        job_file = os.path.join(job.out_dir, "job.json")
        with open(job_file, "w") as f:
            json.dump(spec, f, indent=1)
        env = env_with_source_path()
        root = source_root()
        env["OMP_NUM_THREADS"] = str(self.cfg.threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(self.extra_env)
        t0 = time.monotonic()
        with self._cv:
            if self._closed:
                self._report_failure(job, f"not run: {self._close_reason}")
                return
            with open(job.log_path, "ab") as logf:
                # same process group as the master: the launcher's stop reaches it too
                self._proc = subprocess.Popen(self.cmd + [job_file], stdout=logf, stderr=subprocess.STDOUT, env=env,
                                              cwd=root, stdin=subprocess.DEVNULL)
            proc = self._proc
        logger.info(f"auto_eval: evaluating global step {job.global_step} ({job.model_path}) in pid {proc.pid}; "
                    f"log {job.log_path}")
        timeout = self.cfg.timeout
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop(proc)
            self._report_failure(job, f"timed out after {timeout:.0f} s (auto_eval.timeout)")
            return
        dt = time.monotonic() - t0
        with self._cv:
            closed = self._closed
        if closed:
            self._report_failure(job, f"stopped: {self._close_reason}")
            return
        if code != 0:
            why = f"exit code {code}" if code > 0 else f"killed by signal {-code}"
            self._report_failure(job, f"evaluation process failed ({why})")
            return
        try:
            with open(job.result_path) as f:
                metrics = json.load(f)["metrics"]
        except (OSError, ValueError, KeyError) as e:
            self._report_failure(job, f"no readable result ({e})")
            return
        flat = flatten_metrics(metrics)
        self.results[job.global_step] = {"metrics": metrics}
        self._log(job.global_step, {**flat, "auto_eval/seconds": dt})
        logger.info(f"auto_eval: global step {job.global_step} evaluated in {dt:.1f}s: "
                    + ", ".join(f"{k}={v:.4g}" for k, v in flat.items()))

    def _stop(self, proc: subprocess.Popen, grace: float = 10.0):
        if proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)  # unwinds evaluate_checkpoint (workers and graders stopped)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass

    def _report_failure(self, job: EvalJob, why: str):
        self.results[job.global_step] = {"error": why}
        logger.error(f"auto_eval: evaluation of global step {job.global_step} ({job.model_path}) failed: {why}; "
                     f"training continues. Log {job.log_path}, last lines:\n{tail(job.log_path, n=40)}")
        self._log(job.global_step, {"auto_eval/failed": 1.0, "auto_eval/error": why})

    def _log(self, step: int, stats: dict):
        try:
            self.stats.log_past(step, stats)
        except Exception as e:  # e.g. the stats logger was closed: the result stays in the log
            logger.warning(f"auto_eval: could not log the results of global step {step}: {e!r}")


def make_evaluator(spec, stats) -> Optional[AutoEvaluator]:
    """The evaluator of an experiment spec (None unless ``auto_eval.enabled``)."""
    cfg = getattr(spec, "auto_eval", None)
    if cfg is None or not cfg.enabled:
        return None
    if not (spec.save_freq_steps or spec.save_freq_epochs or spec.save_freq_secs):
        logger.warning("auto_eval.enabled=true but no exp_ctrl.save_freq_* is set: no checkpoint will be evaluated")
    out = cfg.output_dir or os.path.join(os.path.dirname(os.path.abspath(spec.log_dir)), "eval")
    return AutoEvaluator(cfg, stats, out)


# ---------------------------------------------------------------------- the evaluation subprocess
def main(argv=None) -> int:
    """``python -m realhf.system.trainer.evaluator JOB.json``: evaluate one checkpoint, write the result file."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m realhf.system.trainer.evaluator JOB.json", file=sys.stderr)
        return 2
    exit_when_parent_dies(exit_code=1)  # never left running when the master is gone

    def _term(signum, frame):
        raise SystemExit(128 + signum)  # unwinds evaluate_checkpoint: its workers are stopped

    signal.signal(signal.SIGTERM, _term)
    with open(argv[0]) as f:
        job = json.load(f)
    opts = dict(job["options"])
    import torch

    if opts.get("threads_per_worker"):
        torch.set_num_threads(int(opts["threads_per_worker"]))
    from realhf.evaluation.runner import EvalError, evaluate_checkpoint

    t0 = time.perf_counter()
    try:
        metrics = evaluate_checkpoint(job["model_path"], job["output_path"], job["data_names"], **opts)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    res = {"global_step": job.get("global_step"), "model_path": job["model_path"], "metrics": metrics,
           "seconds": time.perf_counter() - t0}
    tmp = job["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, job["result_path"])
    print(json.dumps({"metrics": metrics}), flush=True)
    return 0


if __name__ == "__main__":
    from realhf.base.process import exit_done

    exit_done(main())
