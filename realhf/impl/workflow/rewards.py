"""Rewards of rollout workflows: ``await reward_fn(completion_text, data) -> float``.

:class:`MathReward` (the default, :data:`DEFAULT_REWARD_FN`) is the one grader of math answers: a synchronous
run's ``rw-math`` interface grades its batches with it (:meth:`MathReward.grade_many`), a rollout workflow awaits
it per answer. Both are built from the experiment's ``reward`` section
(``realhf.api.quickstart.reward_config.RewardConfig.grader_args``). Grading is ``realhf.reward``'s: extraction,
then a comparison with the row's ``solutions`` that is bounded by ``timeout_secs`` and runs symbolic work in
isolated worker processes; awaited, it runs in a thread of its own executor, so the rollout worker's event loop
never waits on it.

A workflow that knows how an answer ended passes it to :func:`call_reward` (``finish_reason``: "stop" when a stop
token ended it, "length" when max_new_tokens cut it); the reward then sees ``data["finish_reason"]``. With
``unfinished_as_wrong`` :class:`MathReward` scores an answer that did not end with a stop token ``wrong_reward``,
as a synchronous run's ``rw-math`` does with ``seq_no_eos_mask``.

A user's reward is named by import path (:func:`load_reward_fn`): a class, built with the experiment's reward
options, whose instances are called ``(completion_text, data)``, or a function taking ``(completion_text, data)``.
Either may be ``async``; a synchronous one is run in a thread (:func:`call_reward`), as it may block.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from realhf.api.core.workflow_api import import_object
from realhf.base import logging

logger = logging.getLogger(__name__)

DEFAULT_REWARD_FN = "realhf.impl.workflow.rewards:MathReward"


class MathReward:
    """``correct_reward`` when the answer of the completion (its last ``\\boxed{}``, ``#### N``, "the answer
    is ..."; with ``allow_last_number`` also its last number) equals one of ``data["solutions"]``, else
    ``wrong_reward`` (also when no answer is stated, and when grading timed out or failed: those are counted in
    :attr:`stats`). With ``unfinished_as_wrong``, also when ``data["finish_reason"]`` is not ``"stop"`` (the
    answer was cut before it ended; not graded, counted as ``unfinished``); the workflow must give the finish
    reason (:func:`call_reward`'s ``finish_reason``), else grading raises a ``KeyError`` rather than let the
    option pass unused."""

    def __init__(self, correct_reward: float = 5.0, wrong_reward: float = -5.0, timeout_secs: float = 5.0,
                 allow_last_number: bool = False, unfinished_as_wrong: bool = False, max_workers: int = 2,
                 max_threads: int = 8):
        for name, v in (("correct_reward", correct_reward), ("wrong_reward", wrong_reward)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"MathReward {name} must be a finite number, got {v!r}")
        if not (isinstance(timeout_secs, (int, float)) and timeout_secs > 0):
            raise ValueError(f"MathReward timeout_secs must be > 0, got {timeout_secs!r}")
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.timeout_secs = float(timeout_secs)
        self.allow_last_number = bool(allow_last_number)
        self.unfinished_as_wrong = bool(unfinished_as_wrong)
        self.n_unfinished = 0
        self.max_workers, self.max_threads = int(max_workers), int(max_threads)
        self._verifier = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _start(self):
        """The verifier (its grading processes start when a comparison first needs one) and the grading threads."""
        with self._lock:
            if self._verifier is None:
                from realhf.reward import MathVerifier

                self._verifier = MathVerifier(timeout=self.timeout_secs, max_workers=self.max_workers)
                self._executor = ThreadPoolExecutor(self.max_threads, thread_name_prefix="math-reward")
            return self._verifier, self._executor

    @property
    def verifier(self):
        return self._start()[0]

    @property
    def stats(self) -> Dict[str, int]:
        """Counts of graded answers: total, ok, timeout, error, correct; and unfinished (scored wrong ungraded)."""
        return {**self.verifier.stats, "unfinished": self.n_unfinished}

    def _graded_text(self, text: str) -> str:
        """The text the verifier reads: with ``allow_last_number``, an answer that states none is its last number."""
        from realhf.reward import extract_answer

        text = text or ""
        if self.allow_last_number and extract_answer(text) is None:
            a = extract_answer(text, allow_last_number=True)
            if a:
                return f"\\boxed{{{a}}}"
        return text

    def grade_many(self, texts: Sequence[str], solutions: Sequence[Sequence[Any]],
                   unfinished: Optional[Sequence[bool]] = None) -> List[Tuple[float, str]]:
        """``(reward, status)`` of each answer against its own solutions, graded in the calling thread (blocking).
        ``status``: the verifier's ``"ok"``, ``"timeout"`` or ``"error"`` (the last two score ``wrong_reward``), or
        ``"unfinished"``: with ``unfinished_as_wrong`` an answer whose ``unfinished`` entry is true (cut before it
        ended) scores ``wrong_reward`` ungraded."""
        cut = [bool(u) and self.unfinished_as_wrong for u in (unfinished or [False] * len(texts))]
        graded = [i for i, c in enumerate(cut) if not c]
        out: List[Tuple[float, str]] = [(self.wrong_reward, "unfinished")] * len(texts)
        results = self.verifier.verify_batch([self._graded_text(texts[i]) for i in graded],
                                             [[str(s) for s in solutions[i]] for i in graded],
                                             timeout=self.timeout_secs) if graded else []
        for i, (ok, status) in zip(graded, results):
            out[i] = (self.correct_reward if ok else self.wrong_reward, status)
        if any(cut):
            with self._lock:
                self.n_unfinished += sum(cut)
        return out

    def grade(self, completion_text: str, data: Dict[str, Any]) -> float:
        """The reward, computed in the calling thread (blocking: at most about ``timeout_secs``)."""
        sols = data.get("solutions")
        if not sols:
            raise KeyError(f"MathReward needs data['solutions'] (the reference answers) for query "
                           f"{data.get('query_id')!r}; a math prompt dataset provides them")
        if self.unfinished_as_wrong and "finish_reason" not in data:
            raise KeyError(f"MathReward(unfinished_as_wrong=True) needs data['finish_reason'] for query "
                           f"{data.get('query_id')!r}: the workflow must say how each answer ended "
                           "(call_reward(..., finish_reason=...)), as rlvr does")
        unfinished = self.unfinished_as_wrong and data["finish_reason"] != "stop"
        [(reward, status)] = self.grade_many([completion_text], [sols], [unfinished])
        if status not in ("ok", "unfinished"):
            logger.info("math reward of query %r: verification %s, scored as wrong", data.get("query_id"), status)
        return reward

    async def __call__(self, completion_text: str, data: Dict[str, Any]) -> float:
        _, executor = self._start()
        return await asyncio.get_running_loop().run_in_executor(executor, self.grade, completion_text, data)

    def close(self):
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
            if self._verifier is not None:
                self._verifier.close()
            self._verifier = self._executor = None


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def call_reward(fn: Callable, completion_text: str, data: Dict[str, Any],
                      finish_reason: Optional[str] = None) -> float:
    """``fn(completion_text, data)`` as a float without blocking the event loop: awaited when ``fn`` is async,
    else run in a thread of the loop's default executor. ``finish_reason`` (how the answer ended: "stop",
    "length", ...), when given, reaches ``fn`` as ``data["finish_reason"]`` (in a copy of ``data``)."""
    if finish_reason is not None:
        data = {**data, "finish_reason": str(finish_reason)}
    if _is_async(fn):
        r = await fn(completion_text, data)
    else:
        r = await asyncio.get_running_loop().run_in_executor(None, fn, completion_text, data)
        if inspect.isawaitable(r):
            r = await r
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        raise ValueError(f"reward function {name} returned {r!r}; a reward is a finite number")
    return float(r)


def load_reward_fn(spec: Union[str, Callable, None] = None, **reward_args) -> Callable:
    """The reward callable of ``spec``: None (the default :class:`MathReward`), an import path
    ``"package.module:Name"`` or an object. A class is built with those of ``reward_args`` its constructor takes
    (the others are named in a warning); a function or any other callable is used as it is (``reward_args`` then
    unused, with a warning)."""
    if spec is None:
        spec = DEFAULT_REWARD_FN
    where = spec if isinstance(spec, str) else repr(spec)
    obj = import_object(spec, "reward_fn") if isinstance(spec, str) else spec
    if isinstance(obj, type):
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):  # no signature to read: give it every option
            params = {}
            takes_all = True
        else:
            takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        use = {k: v for k, v in reward_args.items() if takes_all or k in params}
        unused = sorted(set(reward_args) - set(use))
        if unused:
            logger.warning("reward_fn %s does not take %s; those reward options are not used", where, unused)
        try:
            obj = obj(**use)
        except TypeError as e:
            raise TypeError(f"reward_fn {where}: cannot build it with {sorted(use)}: {e}") from e
    elif reward_args:
        logger.warning("reward_fn %s is not a class; the reward options %s are not used", where, sorted(reward_args))
    if not callable(obj):
        raise TypeError(f"reward_fn {where} is {obj!r}, not callable as (completion_text, data)")
    return obj
