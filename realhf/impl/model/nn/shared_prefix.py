"""A forward pass that computes each shared prompt once: the answers of a group attend to one copy of its prompt.

A PPO/GRPO batch packs ``group_size`` answers after copies of the same prompt (DPO: a chosen and a rejected answer
after one prompt). :func:`share_prefixes` finds runs of adjacent sequences with a common first part and lays the
micro-batch out as a tree: each shared prefix once, then every member's own tokens (its *suffix*). The blocks run
on that compact layout: the prefix's queries attend causally within the prefix, a suffix's queries to the whole
prefix and causally within the suffix (positions continue from the prefix, so rotary and learned position
embeddings see the same positions as the plain layout). Before the output head, :attr:`PrefixTree.expand` maps every
token of the original layout to its compact row, so heads, log-probs and losses see the plain layout's rows; in the
backward pass the gradients of a prefix's rows sum over the members that read it. The result is the plain forward's
up to rounding (``tests``: outputs and gradients against the plain layout, tp and pp included); the work of a
group's blocks falls from ``n * (prompt + answer)`` tokens to ``prompt + n * answer``.

Attention over the tree: each query segment (a prefix, a suffix, or an unshared sequence) has its keys listed in
``k_index`` (a suffix's: its prefix's rows, then its own), causal aligned at the bottom right (query ``t`` of a
segment with ``Lq`` queries and ``Lk`` keys sees keys ``0 .. t + Lk - Lq``). ``kernel="flash"`` hands that to
flash-attn's varlen kernel (separate query and key offsets, causal is bottom-right there); it has not run on a GPU
here, as flash-attn is not installable on the machines this was built on. Otherwise segments of similar key length
are padded into batches and attended under an explicit mask.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

import torch

from realhf.impl.model.nn.attention import bucketed_attention, flash_attn_varlen

# A prefix shorter than this is not shared (the bookkeeping would cost more than the saved tokens), nor is a
# micro-batch's layout changed unless it saves at least MIN_SAVING of its tokens.
MIN_PREFIX = 8
MIN_SAVING = 0.1


@dataclasses.dataclass
class PrefixTree:
    """The compact layout of one micro-batch (rows: compact tokens; ``expand``: one entry per original token)."""

    expand: torch.Tensor  # int64 [T]: the compact row of every token of the original layout
    q_cu: torch.Tensor  # int32 [S+1]: query segments, contiguous in the compact layout
    k_index: torch.Tensor  # int64 [sum Lk]: the compact rows of every segment's keys, segment by segment
    k_cu: torch.Tensor  # int32 [S+1]
    max_q: int
    max_k: int
    q_lens: List[int]
    k_lens: List[int]


def _groups(seqs: List[List[int]]) -> List[Tuple[int, int, int]]:
    """(first, end, prefix length) of each run of adjacent sequences that share a prefix worth sharing (greedy:
    a sequence joins the run while its common prefix with the run's first is at least MIN_PREFIX; every member
    keeps at least one token of its own)."""
    out, i, n = [], 0, len(seqs)
    while i < n:
        j, common = i + 1, len(seqs[i])
        while j < n:
            lcp = len(os.path.commonprefix([seqs[i], seqs[j]]))
            if lcp < MIN_PREFIX:
                break
            common = min(common, lcp)
            j += 1
        shared = min([common] + [len(s) - 1 for s in seqs[i:j]])
        if j - i > 1 and shared >= MIN_PREFIX:
            out.append((i, j, shared))
        i = j
    return out


def _segments(ids: torch.Tensor, seqlens: List[int]) -> Optional[List[Tuple[str, int, int, int]]]:
    """The compact layout's query segments, in order, as (kind, start of its tokens in the original layout, length,
    position of its first token): kind "alone" (a sequence shared with no other), "prefix" (a run's common prefix)
    or "member" (a run member's own tokens, after its prefix). None where sharing would save under MIN_SAVING of the
    tokens."""
    if len(seqlens) < 2:
        return None
    flat = ids.tolist()
    starts = [0]
    for L in seqlens:
        starts.append(starts[-1] + L)
    groups = _groups([flat[starts[i]:starts[i + 1]] for i in range(len(seqlens))])
    if sum((j - i - 1) * L for i, j, L in groups) < MIN_SAVING * len(flat):
        return None
    by_first = {i: (j, L) for i, j, L in groups}
    out, i = [], 0
    while i < len(seqlens):
        if i not in by_first:
            out.append(("alone", starts[i], seqlens[i], 0))
            i += 1
            continue
        j, L = by_first[i]
        out.append(("prefix", starts[i], L, 0))
        out += [("member", starts[m] + L, seqlens[m] - L, L) for m in range(i, j)]
        i = j
    return out


def segment_lengths(ids: torch.Tensor, seqlens: List[int]) -> List[int]:
    """The query lengths of the segments :func:`share_prefixes` lays ``ids`` out in (``seqlens`` where it leaves the
    layout as it is), without building the layout: what the blocks attend over, for the memory model."""
    segs = _segments(ids, seqlens)
    return list(seqlens) if segs is None else [length for _, _, length, _ in segs]


def share_prefixes(ids: torch.Tensor, seqlens: List[int],
                   device=None) -> Optional[Tuple[torch.Tensor, torch.Tensor, PrefixTree]]:
    """(compact ids, compact position ids, tree) of packed ``ids`` [T] with ``seqlens``, on ``device`` (default the
    ids'), or None where no prefix worth sharing is found (or sharing would save under MIN_SAVING of the tokens).
    The layout is worked out where ``ids`` live (the host, before they move: no device round trip)."""
    segs = _segments(ids, seqlens)
    if segs is None:
        return None
    src_parts, pos, expand_parts, q_lens, k_parts, k_lens = [], [], [], [], [], []
    n_rows, prefix = 0, None
    for kind, src, length, first_pos in segs:
        own = torch.arange(n_rows, n_rows + length)
        n_rows += length
        src_parts.append(torch.arange(src, src + length))
        pos.append(torch.arange(first_pos, first_pos + length))
        keys = torch.cat([prefix, own]) if kind == "member" else own
        q_lens.append(length)
        k_parts.append(keys)
        k_lens.append(keys.numel())
        if kind == "prefix":
            prefix = own  # its rows are read by the members that follow; its tokens expand only through them
        else:
            expand_parts.append(keys)  # a member's tokens in the original layout: its prefix's rows, then its own
    dev = ids.device if device is None else torch.device(device)
    q_cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    q_cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    k_cu = torch.zeros(len(k_lens) + 1, dtype=torch.int32)
    k_cu[1:] = torch.cumsum(torch.tensor(k_lens, dtype=torch.int32), 0)
    tree = PrefixTree(expand=torch.cat(expand_parts).to(dev), q_cu=q_cu.to(dev), k_index=torch.cat(k_parts).to(dev),
                      k_cu=k_cu.to(dev), max_q=max(q_lens), max_k=max(k_lens), q_lens=q_lens, k_lens=k_lens)
    compact = ids.index_select(0, torch.cat(src_parts).to(ids.device))
    return compact.to(dev), torch.cat(pos).to(dev), tree


def tree_attention(q, k, v, tree: PrefixTree, scale: float, kernel: str = "sdpa"):
    """q: [R, hq, d]; k, v: [R, hkv, d] over the compact rows -> [R, hq, d] (see the module's docstring)."""
    kt, vt = k.index_select(0, tree.k_index), v.index_select(0, tree.k_index)
    if kernel == "flash" and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_varlen()(q, kt, vt, tree.q_cu, tree.k_cu, tree.max_q, tree.max_k, softmax_scale=scale,
                                   causal=True)
    return bucketed_attention(q, kt, vt, tree.q_cu[:-1].long(), tree.q_lens, tree.k_cu[:-1].long(), tree.k_lens, scale)
