"""Grading completions against reference solutions: one entry point for rewards and evaluation.

* :func:`verify_math` — bool for one completion (shared default worker pool).
* :class:`MathVerifier` — for training: many completions at once with a thread pool over the
  worker processes, ``(correct, status)`` per completion and running counts of statuses.

A reference solution may be a worked solution (its last ``\\boxed{}``, else its ``#### N``
line, is the answer) or a bare answer (used as is).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from realhf.base import logging
from realhf.reward.equal import compare_answers
from realhf.reward.extract import _GSM_RE, extract_answer, gsm8k_answer, last_boxed
from realhf.reward.safe import WorkerPool, get_default_pool

logger = logging.getLogger(__name__)

# A longer completion is graded on its last MAX_COMPLETION_CHARS characters (where its final answer
# is). Extraction is linear in the length, so this caps the grading work done in the calling thread
# (at most some tens of milliseconds, whatever the text) before the comparisons, which check the
# deadline themselves.
MAX_COMPLETION_CHARS = 200_000


def reference_answer(solution) -> str | None:
    """The answer of a reference: last ``\\boxed{}``, else ``#### N``, else the text itself."""
    if solution is None:
        return None
    if isinstance(solution, float) and solution.is_integer():
        solution = int(solution)
    s = str(solution).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        return boxed
    if _GSM_RE.search(s):
        try:
            return gsm8k_answer(s)
        except ValueError:
            pass
    return s or None


def _as_list(solutions) -> list:
    if solutions is None:
        return []
    if isinstance(solutions, (str, int, float)):
        return [solutions]
    return list(solutions)


def verify_math_status(
    completion: str,
    solutions: Sequence[str] | str,
    timeout: float = 5.0,
    rel_tol: float = 1e-4,
    pool: WorkerPool | None = None,
) -> tuple[bool, str]:
    """``(correct, status)``: the completion's extracted answer equals any reference answer.

    ``timeout`` bounds the whole call, extraction and all references together. Status is ``"ok"``
    unless a comparison gave up (``"timeout"`` / ``"error"``) and no reference matched.
    """
    deadline = time.monotonic() + timeout
    if not completion:
        return False, "ok"
    pred = extract_answer(completion[-MAX_COMPLETION_CHARS:])
    if pred is None:
        return False, "ok"
    worst = "ok"
    for sol in _as_list(solutions):
        ref = reference_answer(sol)
        if ref is None:
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return False, "timeout"
        ok, status = compare_answers(pred, ref, rel_tol=rel_tol, timeout=left, pool=pool)
        if ok:
            return True, "ok"
        if status == "timeout" or (status == "error" and worst == "ok"):
            worst = status
    return False, worst


def verify_math(completion: str, solutions: Sequence[str] | str, timeout: float = 5.0) -> bool:
    """Whether the answer of ``completion`` (``\\boxed{}``, ``#### N``, "the answer is ...")
    matches any of ``solutions`` (worked solutions or bare answers)."""
    return verify_math_status(completion, solutions, timeout=timeout)[0]


class _NeedsWorker(Exception):
    """Raised by ``_NO_WORKERS``: this comparison needs a worker process."""


class _NoWorkers:
    """Stands in for the worker pool in ``verify_batch``'s first pass, which grades in the calling thread
    only what needs no worker process; a comparison that would run in one is deferred instead."""

    max_workers = 1

    def run(self, task: str, args: list, timeout: float):
        raise _NeedsWorker(task)


_NO_WORKERS = _NoWorkers()


class MathVerifier:
    """Batch grading with shared, bounded worker processes and status counts.

    >>> v = MathVerifier(timeout=5.0, max_workers=2)
    >>> v.verify_batch(["... \\\\boxed{4}"], [["2+2 = \\\\boxed{4}"]])
    [(True, 'ok')]
    >>> v.stats  # {'total': 1, 'ok': 1, 'timeout': 0, 'error': 0, 'correct': 1}
    """

    def __init__(
        self,
        timeout: float = 5.0,
        max_workers: int | None = None,
        rel_tol: float = 1e-4,
        pool: WorkerPool | None = None,
    ):
        self.timeout = timeout
        self.rel_tol = rel_tol
        self._own_pool = pool is None and max_workers is not None
        if pool is not None:
            self.pool = pool
        elif max_workers is not None:
            self.pool = WorkerPool(max_workers)
        else:
            self.pool = get_default_pool()
        self._lock = threading.Lock()
        self._stats = {"total": 0, "ok": 0, "timeout": 0, "error": 0, "correct": 0}

    def _record(self, ok: bool, status: str):
        with self._lock:
            self._stats["total"] += 1
            self._stats[status] = self._stats.get(status, 0) + 1
            self._stats["correct"] += int(ok)

    @property
    def stats(self) -> dict:
        """Counts since construction or :meth:`reset_stats`: total, ok, timeout, error, correct."""
        with self._lock:
            return dict(self._stats)

    def reset_stats(self):
        with self._lock:
            for k in self._stats:
                self._stats[k] = 0

    def verify(self, completion: str, solutions, timeout: float | None = None) -> tuple[bool, str]:
        return self._verify(completion, solutions, timeout, self.pool)

    def _verify(self, completion: str, solutions, timeout: float | None, pool) -> tuple[bool, str]:
        t = self.timeout if timeout is None else timeout
        try:
            ok, status = verify_math_status(completion, solutions, timeout=t, rel_tol=self.rel_tol, pool=pool)
        except _NeedsWorker:
            raise
        except Exception as e:  # grading must never take the trainer down
            logger.warning("math verification failed: %s: %s", type(e).__name__, e)
            ok, status = False, "error"
        self._record(ok, status)
        return ok, status

    def verify_batch(
        self,
        completions: Sequence[str],
        solutions_list: Sequence,
        timeout: float | None = None,
        max_workers: int | None = None,
    ) -> list[tuple[bool, str]]:
        """``[(correct, status)]`` for each completion against its own list of solutions.

        ``max_workers`` threads (default: the pool size) feed the worker processes; fast-path
        comparisons run in the calling threads without a process round trip.
        """
        if len(completions) != len(solutions_list):
            raise ValueError(f"{len(completions)} completions but {len(solutions_list)} solution lists")
        n_threads = max(1, max_workers or self.pool.max_workers)
        if n_threads == 1 or len(completions) <= 1:
            return [self.verify(c, s, timeout) for c, s in zip(completions, solutions_list)]
        # Most answers are decided by the string/number comparisons, in microseconds: grade them all here
        # first, and hand only those needing a worker process (a symbolic comparison) to the threads.
        results: list = [None] * len(completions)
        deferred = []
        for i, (c, s) in enumerate(zip(completions, solutions_list)):
            try:
                results[i] = self._verify(c, s, timeout, _NO_WORKERS)
            except _NeedsWorker:
                deferred.append(i)
        if deferred:
            with ThreadPoolExecutor(min(n_threads, len(deferred)), thread_name_prefix="math-verify") as ex:
                for i, r in zip(deferred, ex.map(lambda i: self.verify(completions[i], solutions_list[i], timeout),
                                                  deferred)):
                    results[i] = r
        return results

    def close(self):
        """Stop the worker processes if this verifier created its own pool."""
        if self._own_pool:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
