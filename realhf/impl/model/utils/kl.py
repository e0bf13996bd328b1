"""KL divergence to a reference policy: per-token estimators, the KL-shaped reward, and KL coefficient controllers.

The estimators are Schulman's ("Approximating KL Divergence", 2020), each a function of the sampled token's
log-probability under the policy ``p`` (``logp``) and under the reference ``q`` (``ref_logp``), for tokens sampled
from ``p``. ``ppo.kl_estimator`` picks the one of the KL penalty in the reward (``ppo.kl_ctl``), and
``ppo.kl_loss_estimator`` the one of the KL loss term (``ppo.kl_loss_coef``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from realhf.base import logging
from realhf.impl.model.utils.masked import check_mask, last_masked_index

logger = logging.getLogger(__name__)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k1 = log p(x) - log q(x) with x ~ p: unbiased for KL(p||q), high variance, can be < 0."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k2 = 0.5 * (log p(x) - log q(x))^2: biased, low variance, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = exp(d) - d - 1 with d = log q(x) - log p(x): unbiased for KL(p||q) and >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2,
                                                                                   "k3": kl_k3}


def kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The estimator named ``name`` (k1, k2 or k3)."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {name!r} is not known; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def kl_reward_shaping(
    task_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_ctl: float,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    max_reward_clip: Optional[float] = None,
    estimator: str = "k1",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards for PPO with a KL penalty to a reference policy::

        kl_rewards_t    = -kl_ctl * k(logprobs_t, ref_logprobs_t) * mask_t          (k: the estimator, k1 by default)
        token_rewards_t = kl_rewards_t + [t == last masked token of its sequence] * clip(task_reward, +-max_reward_clip)

    ``task_rewards`` has one entry per sequence; ``cu_seqlens`` indexes the per-token tensors. A sequence
    without any masked token receives no task reward (it would not be trained on anyway).
    ``max_reward_clip=None`` leaves task rewards unclipped. Returns ``(token_rewards, kl_rewards)``.
    """
    check_mask(logprobs, loss_mask, "logprobs")
    n = cu_seqlens.numel() - 1
    assert task_rewards.numel() == n, f"task_rewards has {task_rewards.numel()} entries for {n} sequences"
    kl = kl_estimator(estimator)(logprobs, ref_logprobs)
    kl_rewards = torch.where(loss_mask, -kl_ctl * kl, torch.zeros_like(logprobs))
    r = task_rewards.to(kl_rewards.dtype).reshape(-1)
    if max_reward_clip is not None:
        r = r.clamp(-max_reward_clip, max_reward_clip)
    last = last_masked_index(cu_seqlens, loss_mask)
    has = last >= 0
    token_rewards = kl_rewards.clone()
    token_rewards.index_add_(0, last[has], r[has])
    if not bool(has.all()):
        logger.debug(f"kl_reward_shaping: {int((~has).sum())} sequence(s) have no answer tokens; no task reward placed")
    return token_rewards.detach(), kl_rewards.detach()


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float):
        assert kl_coef >= 0, f"kl_coef must be >= 0, got {kl_coef}"
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences")::

        e      = clip(current_kl / target - 1, -0.2, 0.2)
        value *= 1 + e * n_steps / horizon

    The coefficient grows when the observed KL exceeds ``target`` and shrinks when it is below.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        assert init_kl_coef >= 0, f"init_kl_coef must be >= 0, got {init_kl_coef}"
        assert target > 0, f"target KL must be > 0, got {target}"
        assert horizon > 0, f"horizon must be > 0, got {horizon}"
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
