"""Token-level functions over packed sequences shared by the interfaces (SFT, PPO, ...)."""
from __future__ import annotations

from typing import Tuple, Union

import torch

from realhf.impl.model.nn.chunked_head import HeadOutput, head_logprobs, logits_logprobs
from realhf.impl.model.parallelism.tensor_parallel import vocab_parallel_entropy

# The last stage's output: logits [N, V/tp], or the deferred head (log-probs computed chunk by chunk)
HeadOut = Union[torch.Tensor, HeadOutput]


def label_logprobs(out: HeadOut, labels: torch.Tensor, tp_group=None, temperature: float = 1.0,
                   entropy: bool = False):
    """log p(labels[i]) under softmax(out[i] / temperature), fp32 [N] (vocab-parallel), and with ``entropy`` each
    row's entropy too. ``out``: whole logits, or a ``HeadOutput`` (the log-softmax then runs chunk by chunk,
    never holding the whole logits)."""
    if isinstance(out, HeadOutput):
        return head_logprobs(out, labels, temperature, entropy=entropy)
    return logits_logprobs(out, labels, tp_group, temperature, entropy)


def next_token_targets(ids: torch.Tensor, cu_seqlens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Targets ``ids[t+1]`` for every packed position and a mask that is False on each sequence's last token."""
    labels = torch.roll(ids, -1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[(cu_seqlens[1:] - 1).long()] = False
    return labels, valid


def packed_logprobs(out: HeadOut, ids: torch.Tensor, cu_seqlens: torch.Tensor, tp_group=None,
                    temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """log p(ids[t+1] | ids[:t+1]) at every packed position (vocab-parallel), and the validity mask.

    Entries at each sequence's last position are 0 and masked out.
    """
    labels, valid = next_token_targets(ids, cu_seqlens)
    lp = label_logprobs(out, labels, tp_group, temperature)
    return lp * valid.to(lp.device), valid


def logprobs_at(out: HeadOut, ids: torch.Tensor, rows: torch.Tensor, tp_group=None,
                temperature: float = 1.0, entropy: bool = False):
    """log p(ids[t+1] | ids[:t+1]) for the packed positions ``t`` in ``rows`` (each before its sequence's last
    token), from the head output at those positions only (one row per entry of ``rows``: the head ran
    with ``head_rows=rows``); with ``entropy``, also the entropy of each of those rows' distributions."""
    return label_logprobs(out, ids[rows + 1], tp_group, temperature, entropy=entropy)


def packed_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    return vocab_parallel_entropy(logits, tp_group)


def answer_loss_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """True at packed positions whose *next* token is an answer (non-prompt) token of the same sequence."""
    nxt = torch.roll(~prompt_mask.bool(), -1)
    nxt[(cu_seqlens[1:] - 1).long()] = False
    return nxt
