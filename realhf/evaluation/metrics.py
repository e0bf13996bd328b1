"""Evaluation metrics: unbiased pass@k, majority vote, aggregation over problems.

``pass_at_k(n, c, k) = 1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021), computed as the product
``prod_{i=n-c+1}^{n} (1 - k / i)`` so that no large binomial is ever formed.

Majority vote (``maj@k``) over the extracted answers of the first ``k`` samples: answers are grouped
by ``realhf.reward.normalize_answer``; samples without an answer do not vote. Ties: among the most
frequent answers, the one whose first occurrence comes first wins. The voted answer is then graded
(by the caller) like a completion ``\\boxed{answer}``; no answer at all scores 0.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

PASS_KS = (1, 8, 16, 32)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` samples,
    ``c`` of them correct, is correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def majority_vote(answers: Sequence[Optional[str]], k: Optional[int] = None) -> Tuple[Optional[int], Optional[str]]:
    """``(index of the representative sample, voted answer)`` among the first ``k`` answers, or
    ``(None, None)`` when none has an answer. See the module doc for grouping and ties."""
    from realhf.reward import normalize_answer

    answers = list(answers)[: k if k is not None else len(answers)]
    counts: Dict[str, int] = {}
    first: Dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None or not str(a).strip():
            continue
        try:
            key = normalize_answer(str(a))
        except Exception:
            key = str(a).strip()
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None, None
    best = max(counts, key=lambda key: (counts[key], -first[key]))
    return first[best], answers[first[best]]


def dataset_metrics(greedy_scores: Optional[List[List[bool]]], greedy_lengths: Optional[List[List[int]]],
                    sample_scores: Optional[List[List[bool]]], sample_lengths: Optional[List[List[int]]],
                    maj_scores: Optional[List[bool]], n_sampling: int) -> Dict[str, float]:
    """Metrics of one dataset from per-problem lists (accuracies as fractions in [0, 1])."""
    m: Dict[str, float] = {}
    n_q = len(greedy_scores if greedy_scores is not None else (sample_scores or []))
    m["num_questions"] = n_q
    if greedy_scores is not None:
        m["greedy_acc"] = _mean([float(s[0]) for s in greedy_scores])
        m["greedy_length"] = _mean([x for ls in greedy_lengths for x in ls])
    if sample_scores is not None and n_sampling > 0:
        m["sample_length"] = _mean([x for ls in sample_lengths for x in ls])
        m["sample_pass@1"] = _mean([_mean([float(x) for x in s]) for s in sample_scores])
        for k in sorted(set(PASS_KS) | {n_sampling}):
            if k <= n_sampling:
                m[f"pass@{k}"] = _mean([pass_at_k(len(s), int(sum(s)), k) for s in sample_scores])
        m[f"maj@{n_sampling}"] = _mean([float(x) for x in maj_scores])
    return m


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


def format_table(metrics: Dict[str, Dict[str, float]], n_sampling: int) -> str:
    """The results table (accuracies in %, lengths in tokens); ``-`` where a k exceeds n_sampling."""
    cols = ["num_questions", "greedy_length", "sample_length", "greedy_acc", "sample_pass@1"]
    ks = [8, 16] + ([n_sampling] if n_sampling not in (1, 8, 16, 32) and n_sampling > 1 else [])
    cols += [f"pass@{k}" for k in sorted(ks)]
    cols += [f"maj@{n_sampling if n_sampling > 0 else 32}", "pass@32"]
    header = ["dataset"] + cols
    rows = []
    for name, m in metrics.items():
        row = [name]
        for c in cols:
            v = m.get(c)
            if v is None or (isinstance(v, float) and v != v):
                row.append("-")
            elif c == "num_questions":
                row.append(str(int(v)))
            elif c.endswith("length"):
                row.append(f"{v:.1f}")
            else:
                row.append(f"{100 * v:.1f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
