"""The RL algorithm's functions on one page: PPO / GRPO and their variants over packed 1-D token tensors.

Each advantage estimator, loss and KL estimator is one function and one option of ``ppo.*``
(:class:`realhf.api.quickstart.ppo_config.PPOHyperparameters`); they live in modules by idea and are re-exported
here, so ``from realhf.impl.model.utils import ppo_functional as F`` reaches all of them:

* :mod:`~realhf.impl.model.utils.masked`: masked reductions, sequence ids of packed tokens;
* :mod:`~realhf.impl.model.utils.advantages`: critic-free estimators (GRPO / Dr. GRPO, RLOO, REINFORCE++), DAPO's
  overlong reward shaping and overlong filtering;
* :mod:`~realhf.impl.model.utils.losses`: policy losses (PPO with clip-higher and dual clip, GSPO), behaviour
  importance weights (decoupled PPO, TIS, MIS), loss aggregation (token mean, answer mean, Dr. GRPO's constant),
  the value loss, the entropy bonus;
* :mod:`~realhf.impl.model.utils.kl`: KL estimators k1/k2/k3, the KL-shaped reward, KL coefficient controllers;
* :mod:`~realhf.impl.model.utils.normalization`: batch whitening of advantages, running statistics of values;
* :mod:`~realhf.impl.model.utils.gae`: GAE (with a critic).

Conventions shared by every function:

* Per-token tensors are packed: sequences concatenated into one 1-D tensor. Where sequence boundaries
  matter, ``cu_seqlens`` (``[n+1]``, int) indexes the per-token tensors (for PPO on LLMs a sequence of
  ``L`` tokens has ``L - 1`` per-token entries: position ``t`` scores token ``t+1``).
* ``loss_mask`` is a bool tensor of the same shape; True marks answer tokens that count in the loss.
  "mean over the mask" is ``sum(x * mask) / max(sum(mask), 1)``, so an empty mask gives 0, not NaN.
* Losses return ``(loss, stats)``: ``loss`` is a differentiable 0-dim tensor, ``stats`` maps names to
  detached 0-dim float tensors (no device sync; call ``.item()`` when logging).
"""
from __future__ import annotations

from realhf.impl.model.utils.advantages import (broadcast_sequence_advantages, group_normalized_advantages,
                                                length_limit_mask, overlong_penalty, reinforce_returns,
                                                rloo_advantages)
from realhf.impl.model.utils.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimator, kl_k1,
                                        kl_k2, kl_k3, kl_reward_shaping)
from realhf.impl.model.utils.losses import (BEHAV_WEIGHT_MODES, LOSS_AGG_MODES, POLICY_LOSSES, actor_loss,
                                            aggregate_loss, behaviour_weights, critic_loss, entropy_bonus, gspo_loss,
                                            loglinear_proximal_logprobs, loss_weight)
from realhf.impl.model.utils.masked import Stats, last_masked_index, masked_mean, masked_sum, per_seq_sum, seq_ids
from realhf.impl.model.utils.normalization import RunningMeanStd, ValueNormalizer, masked_normalization

__all__ = [
    "Stats", "masked_sum", "masked_mean", "per_seq_sum", "seq_ids", "last_masked_index",
    "group_normalized_advantages", "rloo_advantages", "reinforce_returns", "overlong_penalty",
    "broadcast_sequence_advantages", "length_limit_mask",
    "LOSS_AGG_MODES", "BEHAV_WEIGHT_MODES", "POLICY_LOSSES", "aggregate_loss", "loss_weight", "behaviour_weights",
    "actor_loss", "gspo_loss", "loglinear_proximal_logprobs", "critic_loss", "entropy_bonus",
    "KL_ESTIMATORS", "kl_estimator", "kl_k1", "kl_k2", "kl_k3", "kl_reward_shaping", "FixedKLController",
    "AdaptiveKLController",
    "masked_normalization", "ValueNormalizer", "RunningMeanStd",
]
