"""Contiguous partitions of weighted items (samples by token count): balanced data-parallel splits and
micro-batches under a token budget, and putting per-part results back in order."""
from __future__ import annotations

from typing import Any, Sequence


def _greedy_parts(weights: Sequence[int], cap: int, n_parts: int | None = None) -> list[list[int]]:
    """Cut ``weights`` into contiguous runs; a run is valid if it holds one item or sums to <= cap.

    Runs are extended while valid (which minimises the number of runs). With ``n_parts``, runs are
    also cut early once the remaining items are just enough to give each remaining run one item,
    so the result has exactly ``n_parts`` runs whenever the free greedy needs at most that many.
    """
    parts: list[list[int]] = []
    cur: list[int] = []
    cur_sum = 0
    n = len(weights)
    for i, w in enumerate(weights):
        if cur:
            must_cut = n_parts is not None and n - i <= n_parts - (len(parts) + 1)
            if must_cut or cur_sum + w > cap:
                parts.append(cur)
                cur, cur_sum = [], 0
        cur.append(i)
        cur_sum += w
    if cur:
        parts.append(cur)
    return parts


def balanced_partition(weights: Sequence[int], n: int, cap: int | None = None) -> list[list[int]]:
    """Contiguous partition of ``weights`` into exactly ``n`` non-empty parts minimising the
    largest part sum (exact, by binary search over the bound + greedy check: O(len * log sum)).

    With ``cap``, multi-item parts never exceed ``cap`` (a single item above it stays alone); the
    caller must make sure ``n`` parts suffice (``len(_greedy_parts(weights, cap)) <= n``).
    Deterministic: depends only on ``weights``, ``n`` and ``cap``.
    """
    if n < 1:
        raise ValueError(f"number of parts must be >= 1, got {n}")
    if len(weights) < n:
        raise ValueError(f"cannot split {len(weights)} samples into {n} non-empty parts")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    hi = sum(weights) if cap is None else cap
    if len(_greedy_parts(weights, hi)) > n:
        raise ValueError(f"{n} parts are not enough to keep every part under {hi} tokens")
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_parts(weights, mid)) <= n:
            hi = mid
        else:
            lo = mid + 1
    parts = _greedy_parts(weights, lo, n_parts=n)
    assert len(parts) == n, (len(parts), n)
    return parts


def merge_by_partition(partition: Sequence[Sequence[int]], per_part: Sequence[Sequence[Any]]) -> list:
    """Put per-sample results computed part by part back in the original sample order.

    ``partition[j]`` lists the sample indices of part ``j`` and ``per_part[j]`` the results for
    them, in the same order. Works for any partition (not only contiguous ones).
    """
    if len(partition) != len(per_part):
        raise ValueError(f"{len(partition)} parts but {len(per_part)} result lists")
    n = sum(len(p) for p in partition)
    out: list[Any] = [None] * n
    seen = [False] * n
    for idx, res in zip(partition, per_part):
        if len(idx) != len(res):
            raise ValueError(f"a part has {len(idx)} samples but {len(res)} results")
        for i, r in zip(idx, res):
            if not 0 <= i < n or seen[i]:
                raise ValueError(f"partition is not a permutation of range({n}): index {i}")
            seen[i] = True
            out[i] = r
    return out
