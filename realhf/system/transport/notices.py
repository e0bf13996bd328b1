"""Warnings a user can act on, found in a run's step stats and reported once each: the master logs them and puts
them in ``progress.json``, from where the launcher shows them on the console. Other processes of a run post theirs
next to it (``Notices(log_dir)``, ``realhf.base.progress.post_notice``)."""
from __future__ import annotations

from typing import Dict, List, Optional

from realhf.base import logging
from realhf.base.progress import post_notice

logger = logging.getLogger(__name__)


class Notices:
    """``log_dir``: also post each notice there for the console (a process that writes no ``progress.json``)."""

    def __init__(self, log_dir: Optional[str] = None):
        self.log_dir = log_dir
        self.messages: List[str] = []
        self._seen: set = set()
        self._last: Dict[str, float] = {}

    def add(self, key: str, message: str) -> None:
        """Report ``message`` unless one with ``key`` was reported before."""
        if key in self._seen:
            return
        self._seen.add(key)
        self.messages.append(message)
        logger.warning(message)
        if self.log_dir is not None:
            try:
                post_notice(self.log_dir, message)
            except OSError as e:  # the warning is in this process's log; the console goes without it
                logger.error(f"could not post the notice to {self.log_dir}: {e}")

    def check(self, step: int, stats: dict) -> None:
        """Look at the stats of global ``step`` for what a user should know."""
        no_eos = stats.get("no_eos_ratio")
        if isinstance(no_eos, float) and no_eos >= 0.5:
            self.add("no_eos", f"step {step}: {no_eos:.0%} of the sampled answers hit the max-new-tokens limit "
                               "without ending; raise ppo.gen.max_new_tokens (gen.max_new_tokens) or ask for shorter "
                               "answers")
        spread, reward = stats.get("task_reward_std"), stats.get("task_reward")
        if isinstance(spread, float) and isinstance(reward, float) and spread <= 1e-6 * max(1.0, abs(reward)):
            self.add("flat_reward", f"step {step}: every answer of the batch got the same reward "
                                    f"({stats.get('task_reward')}); with group-normalised advantages nothing is "
                                    "learned from it: check the reward, the answer format or the task's difficulty")
        timeouts = stats.get("n_verify_timeout")
        if isinstance(timeouts, float) and timeouts > 0:
            self.add("grading_timeout", f"step {step}: grading timed out on {timeouts:.0f} answers (scored as wrong); "
                                        "raise reward.timeout_secs if such answers are legitimate")
        for key, value in stats.items():
            if key.endswith("skipped_nonfinite") and isinstance(value, float) and value > self._last.get(key, 0.0):
                self._last[key] = value
                self.add(f"{key}:{value:.0f}", f"step {step}: an update with a non-finite loss or gradient norm was "
                                               f"skipped ({key} = {value:.0f} so far)")
