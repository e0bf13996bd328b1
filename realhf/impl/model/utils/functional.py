"""Token-level functions over packed sequences shared by the interfaces (SFT, PPO, ...)."""
from __future__ import annotations

from typing import Tuple

import torch

from realhf.impl.model.parallelism.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs


def next_token_targets(ids: torch.Tensor, cu_seqlens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Targets ``ids[t+1]`` for every packed position and a mask that is False on each sequence's last token."""
    labels = torch.roll(ids, -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[(cu_seqlens[1:] - 1).long()] = False
    return labels, valid


def packed_logprobs(logits: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor, tp_group=None,
                    temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """log p(ids[t+1] | ids[:t+1]) at every packed position (vocab-parallel), and the validity mask.

    Entries at each sequence's last position are 0 and masked out.
    """
    labels, valid = next_token_targets(ids, cu_seqlens)
    if temperature != 1.0:
        logits = logits.float() / temperature
    lp = vocab_parallel_logprobs(logits, labels, tp_group)
    return lp * valid, valid


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, tp_group=None,
                temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for the packed positions ``t`` in ``rows`` (each before its sequence's last
    token), from ``logits`` computed at those positions only (one row per entry of ``rows``: the head ran
    with ``head_rows=rows``)."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    return vocab_parallel_logprobs(logits, ids[rows + 1].to(logits.device), tp_group)


def packed_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    return vocab_parallel_entropy(logits, tp_group)


def answer_loss_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """True at packed positions whose *next* token is an answer (non-prompt) token of the same sequence."""
    nxt = torch.roll(~prompt_mask.bool(), -1)
    nxt[(cu_seqlens[1:] - 1).long()] = False
    return nxt
