"""Advantage estimators without a critic, and the sequence-level reward shaping and masks that go with them.

Each estimator is one function of the rewards; ``ppo.adv_estimator`` picks it (with a critic, GAE:
:mod:`realhf.impl.model.utils.gae`). Rewards come one per sequence (answer), in consecutive groups of
``group_size`` answers to one prompt; token-level functions take packed tensors with ``cu_seqlens`` and a loss
mask (see :mod:`realhf.impl.model.utils.masked`).
"""
from __future__ import annotations

import torch

from realhf.impl.model.utils.masked import seq_ids


def _groups(rewards: torch.Tensor, group_size: int, who: str) -> torch.Tensor:
    """``rewards`` as ``[n_groups, group_size]`` float64."""
    rewards = rewards.reshape(-1)
    n = rewards.numel()
    assert group_size >= 1, f"group_size must be >= 1, got {group_size}"
    if n % group_size != 0:
        raise ValueError(f"{who}: n_seqs={n} is not a multiple of group_size={group_size}; each prompt must "
                         "contribute exactly group_size answers")
    return rewards.reshape(n // group_size, group_size).double()


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.dtype.is_floating_point else torch.float32


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, std_norm: bool = True
) -> torch.Tensor:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath): rewards of consecutive groups of ``group_size`` sequences
    (answers to one prompt)::

        A_i = (r_i - mean_g) / (std_g + eps)     if std_norm    (std_g: unbiased, Bessel-corrected)
        A_i =  r_i - mean_g                      otherwise      (Dr. GRPO, Liu et al. 2025: no std division)

    A group whose rewards are all equal (including a group of one) gets exactly 0 advantages.
    """
    r = _groups(rewards, group_size, "group_normalized_advantages")
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if std_norm and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(_out_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): each answer's reward minus the
    mean reward of the other answers to its prompt (the leave-one-out baseline)::

        A_i = r_i - 1/(k-1) * sum_{j != i} r_j  =  k/(k-1) * (r_i - mean_g)          (k = group_size >= 2)

    A group whose rewards are all equal gets exactly 0 advantages.
    """
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    r = _groups(rewards, group_size, "rloo_advantages")
    adv = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(_out_dtype(rewards))


def reinforce_returns(token_rewards: torch.Tensor, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor,
                      gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ advantages before normalisation (Hu 2025): per token, the discounted return of the token rewards
    (the task reward at the answer's last token, the KL penalty on every token) from that token on::

        G_t = sum_{s >= t, s masked, same sequence} gamma^(n(s) - n(t)) * r_s      (n: index among the masked tokens)

    0 on unmasked tokens. No baseline: REINFORCE++ then normalises ``G`` over the whole batch (``ppo.adv_norm``).
    """
    assert 0.0 <= gamma <= 1.0, f"gamma must be in [0, 1], got {gamma}"
    T = loss_mask.numel()
    sid, lens = seq_ids(cu_seqlens, T, loss_mask.device)
    x = torch.where(loss_mask, token_rewards.double(), torch.zeros((), dtype=torch.float64, device=loss_mask.device))
    if gamma == 1.0:  # vectorised: the sequence's total minus what came before t
        c = torch.cumsum(x, 0)
        ends = torch.cumsum(lens, 0) - 1
        g = c[ends][sid] - c + x
    else:
        g = torch.zeros_like(x)
        cu = cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            run = 0.0
            for t in reversed(loss_mask[a:b].nonzero().squeeze(-1).tolist()):
                run = float(x[a + t]) + gamma * run
                g[a + t] = run
    return torch.where(loss_mask, g, torch.zeros_like(g)).to(token_rewards.dtype)


def overlong_penalty(answer_lens: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), one reward term per answer: 0 up to ``max_new_tokens -
    buffer_len`` tokens, then falling linearly to ``-factor`` at ``max_new_tokens`` (and ``-factor`` beyond)::

        R_length(y) = clip(((L_max - L_cache) - |y|) / L_cache, -1, 0) * factor     (L_max = max_new_tokens,
                                                                                     L_cache = buffer_len)
    """
    assert 0 < buffer_len <= max_new_tokens, (f"the overlong buffer ({buffer_len} tokens) must be in [1, "
                                              f"max_new_tokens={max_new_tokens}]")
    exceed = answer_lens.double() - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len).clamp(min=-1.0, max=0.0).float() * factor


def broadcast_sequence_advantages(
    seq_adv: torch.Tensor, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """``[T]`` per-token advantages: each sequence's scalar on its masked tokens, 0 elsewhere."""
    seq_adv = seq_adv.reshape(-1)
    sid, lens = seq_ids(cu_seqlens, loss_mask.numel(), loss_mask.device)
    assert seq_adv.numel() == lens.numel(), f"seq_adv has {seq_adv.numel()} entries for {lens.numel()} sequences"
    tok = seq_adv.to(loss_mask.device)[sid]
    return torch.where(loss_mask, tok, torch.zeros_like(tok))


def length_limit_mask(seq_no_eos: torch.Tensor, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``loss_mask`` with every token of the sequences flagged in ``seq_no_eos`` (answers cut by the length
    limit before EOS) turned off (DAPO's overlong filtering)."""
    sid, lens = seq_ids(cu_seqlens, loss_mask.numel(), loss_mask.device)
    assert seq_no_eos.numel() == lens.numel(), f"seq_no_eos has {seq_no_eos.numel()} entries for {lens.numel()} sequences"
    return loss_mask & ~seq_no_eos.to(device=loss_mask.device, dtype=torch.bool).reshape(-1)[sid]
