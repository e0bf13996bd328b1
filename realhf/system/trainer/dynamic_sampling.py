"""DAPO's dynamic sampling in a synchronous run (``ExperimentSpec.dynamic_sampling``).

A prompt whose answers all got the same reward has zero group advantage: it costs a training pass and teaches
nothing. The master runs the rollout part of the graph (the MFC that produces the reward key and the MFCs it
depends on: generation, reward) over a fetched batch, drops the samples (a prompt and its answers) whose values are
all equal, and fetches and generates more batches until it holds a full batch of samples with signal; the rest of the
graph (reference, critic, training) then runs over that batch only. After ``max_rounds`` batches in one step it
fills the batch up with dropped samples (they train nothing but keep the batch's shape) and warns.

Nothing here knows about workers: :func:`fill_batch` takes the three operations as functions.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Sequence, Tuple

from realhf.base import logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FilledBatch:
    kept: List[str]  # the batch to train on (as many samples as one fetch gives)
    all_ids: List[str]  # every sample fetched this step (kept or dropped): to clear afterwards
    info: dict  # the last fetch's epoch info (is_epoch_last: whether any fetch ended an epoch)
    mfc_stats: Dict[str, dict]  # the rollout MFCs' stats over all rounds (times summed)
    stats: Dict[str, float]  # dynamic_sampling/*


def has_signal(values: Sequence[float]) -> bool:
    """Whether a sample's values differ (its answers got different rewards)."""
    return len(set(float(v) for v in values)) > 1


def _merge(into: Dict[str, dict], new: Dict[str, dict]) -> None:
    for mfc, st in new.items():
        cur = into.setdefault(mfc, {})
        for k, v in st.items():
            cur[k] = cur.get(k, 0.0) + v if k.endswith("time") and isinstance(v, (int, float)) else v


def fill_batch(fetch: Callable[[], Tuple[List[str], dict]], run_rollout: Callable[[List[str]], Dict[str, dict]],
               values: Callable[[List[str]], Dict[str, Sequence[float]]], max_rounds: int) -> FilledBatch:
    """``fetch()`` -> (sample ids, epoch info) of the next batch; ``run_rollout(ids)`` runs the rollout MFCs over them
    (-> {mfc: stats}); ``values(ids)`` -> {id: the key's values}. Fetches until as many samples with signal as one
    fetch gives are held, or ``max_rounds`` fetches were made."""
    assert max_rounds >= 1, f"max_rounds must be >= 1, got {max_rounds}"
    kept: List[str] = []
    dropped: List[str] = []
    all_ids: List[str] = []
    total, count = 0.0, 0  # the key's values over every fetched sample, kept or dropped
    mfc_stats: Dict[str, dict] = {}
    batch_size, rounds, epoch_last, info = None, 0, False, {}
    while rounds < max_rounds and (batch_size is None or len(kept) < batch_size):
        ids, info = fetch()
        rounds += 1
        batch_size = len(ids) if batch_size is None else batch_size
        epoch_last = epoch_last or bool(info.get("is_epoch_last", False))
        all_ids += ids
        _merge(mfc_stats, run_rollout(ids))
        vals = values(ids)
        for sid in ids:
            (kept if has_signal(vals[sid]) else dropped).append(sid)
            total += sum(float(v) for v in vals[sid])
            count += len(vals[sid])
    n_signal = len(kept)
    if n_signal < batch_size:
        logger.warning(f"dynamic sampling: {n_signal} of {len(all_ids)} prompts generated in {rounds} rounds have "
                       f"answers with different rewards, fewer than the batch's {batch_size}; the batch is filled up "
                       "with prompts whose answers all got one reward (they train nothing)")
        kept += dropped[: batch_size - n_signal]
    info = dict(info, is_epoch_last=epoch_last)
    stats = {"dynamic_sampling/rounds": float(rounds),
             "dynamic_sampling/signal_frac": n_signal / max(len(all_ids), 1),
             "dynamic_sampling/filled": float(max(batch_size - n_signal, 0)),
             # the trained batch keeps mixed groups only, so its mean reward is not the policy's: this one is
             "dynamic_sampling/all_mean": total / max(count, 1)}
    return FilledBatch(kept[:batch_size], all_ids, info, mfc_stats, stats)
