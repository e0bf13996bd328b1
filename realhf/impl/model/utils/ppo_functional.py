"""PPO / GRPO building blocks over packed 1-D token tensors.

Conventions shared by every function here:

* Per-token tensors are packed: sequences concatenated into one 1-D tensor. Where sequence boundaries
  matter, ``cu_seqlens`` (``[n+1]``, int) indexes the per-token tensors (for PPO on LLMs a sequence of
  ``L`` tokens has ``L - 1`` per-token entries: position ``t`` scores token ``t+1``).
* ``loss_mask`` is a bool tensor of the same shape; True marks answer tokens that count in the loss.
  "mean over the mask" is ``sum(x * mask) / max(sum(mask), 1)``, so an empty mask gives 0, not NaN.
* Losses return ``(loss, stats)``: ``loss`` is a differentiable 0-dim tensor, ``stats`` maps names to
  detached 0-dim float tensors (no device sync; call ``.item()`` when logging).

GAE lives in :mod:`realhf.impl.model.utils.gae`.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.base import logging

logger = logging.getLogger(__name__)

Stats = Dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------


def _check_mask(x: torch.Tensor, mask: torch.Tensor, name: str = "x") -> torch.Tensor:
    assert mask.dtype == torch.bool, f"loss_mask must be a bool tensor, got {mask.dtype}"
    assert mask.shape == x.shape, f"loss_mask shape {tuple(mask.shape)} differs from {name} shape {tuple(x.shape)}"
    return mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i * m_i`` (masked-out entries never contribute, even if they are inf/NaN)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i m_i / max(sum_i m_i, 1)``."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1).to(x.dtype)


def _stat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float()


def _seq_ids(cu_seqlens: torch.Tensor, total: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence id of every packed token ``[T]``, sequence lengths ``[n]``)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    assert int(cu[-1]) == total, f"cu_seqlens ends at {int(cu[-1])} but the per-token tensors have {total} entries"
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens), lens


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    c_clip: Optional[float] = None,
    proximal_logprobs: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate loss, optionally with dual clipping and a decoupled proximal policy.

    Per token, with ``r = exp(logprobs - base)`` where ``base = old_logprobs`` (or ``proximal_logprobs``)::

        l_1 = -A * r
        l_2 = -A * clip(r, 1 - eps_clip, 1 + eps_clip)
        l   = max(l_1, l_2)                                   # standard PPO clip
        l   = min(l, -c_clip * A)       where A < 0           # dual clip (Ye et al. 2020), c_clip > 1
        loss = mean over the mask of  w * l

    ``w = 1`` normally. With ``proximal_logprobs`` (decoupled PPO, as in AReaL's asynchronous RL:
    samples come from a stale behaviour policy ``old``, trust region around a recent proximal policy)
    ``w = exp(proximal_logprobs - old_logprobs)``, the behaviour importance weight, treated as a constant;
    with ``behav_imp_weight_cap`` the tokens whose ``w`` exceeds the cap leave the loss (their sample came
    from a policy too far from the proximal one; stat ``behave_capped_ratio``), and the mean is over the rest.

    Stats (means over the mask): ``importance_weight`` (mean ``r``), ``clip_ratio`` (fraction of tokens
    where the clipped branch is active, ``l_2 > l_1``), ``dual_clip_ratio`` (fraction where the dual-clip
    cap is active), ``approx_kl`` = mean(``base - logprobs``), the k1 estimate of KL(pi_base || pi_theta)
    on samples from pi_base (0 at the first PPO minibatch), ``behave_imp_weight`` (mean ``w``), ``loss``.
    """
    _check_mask(logprobs, loss_mask, "logprobs")
    assert old_logprobs.shape == logprobs.shape and advantages.shape == logprobs.shape, (
        f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and advantages "
        f"{tuple(advantages.shape)} must have the same shape"
    )
    assert eps_clip >= 0, f"eps_clip must be >= 0, got {eps_clip}"
    if c_clip is not None:
        assert c_clip > 1.0, f"c_clip (dual clip) must be > 1, got {c_clip}"

    base = old_logprobs if proximal_logprobs is None else proximal_logprobs
    base = base.detach()
    advantages = advantages.detach()
    log_ratio = torch.where(loss_mask, logprobs - base, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg = torch.maximum(l1, l2)
    clipped = (l2 > l1) & loss_mask
    if c_clip is not None:
        l3 = -c_clip * advantages
        dual = (advantages < 0) & (l3 < pg) & loss_mask
        pg = torch.where(dual, l3, pg)
    else:
        dual = torch.zeros_like(loss_mask)

    capped = torch.zeros_like(loss_mask)
    if proximal_logprobs is not None:
        behave_w = torch.exp(torch.where(loss_mask, proximal_logprobs - old_logprobs, torch.zeros_like(logprobs)))
        behave_w = behave_w.detach()
        pg = pg * behave_w
        if behav_imp_weight_cap is not None:
            assert behav_imp_weight_cap > 0, f"behav_imp_weight_cap must be > 0, got {behav_imp_weight_cap}"
            capped = (behave_w > behav_imp_weight_cap) & loss_mask
    else:
        behave_w = torch.ones_like(logprobs)
    kept = loss_mask & ~capped
    loss = masked_mean(torch.where(kept, pg, torch.zeros_like(pg)), kept)
    n = loss_mask.sum().clamp(min=1).float()
    stats = {
        "importance_weight": _stat(masked_mean(ratio, loss_mask)),
        "clip_ratio": _stat(clipped.sum() / n),
        "dual_clip_ratio": _stat(dual.sum() / n),
        "approx_kl": _stat(masked_mean(base - logprobs, loss_mask)),
        "behave_imp_weight": _stat(masked_mean(behave_w, loss_mask)),
        "behave_capped_ratio": _stat(capped.sum() / n),
        "loss": _stat(loss),
    }
    return loss, stats


def loglinear_proximal_logprobs(behaviour: torch.Tensor, current: torch.Tensor, lag: torch.Tensor,
                                progress: float) -> torch.Tensor:
    """Proximal log-probs of decoupled PPO without a forward pass of the proximal policy (AReaL's "loglinear"
    approximation, with the current policy's version taken fractionally).

    A training step of version ``v`` starts from the proximal parameters and makes ``M`` optimizer updates; at
    update ``m`` the parameters are taken to be at version ``v + progress`` with ``progress = m / M``. A token
    generated at version ``v - lag`` gets, with ``a = lag / (lag + progress)``::

        proximal = behaviour + a * (current - behaviour)        (interpolation in log space)

    It is exact in the two cases that are known: at the first update (``progress == 0``) the parameters being
    trained *are* the proximal ones (``a = 1``: proximal = current), and a token of the current version
    (``lag == 0``) was generated by the proximal parameters (``a = 0``: proximal = behaviour). ``current`` is
    detached: the proximal policy is a constant of the loss."""
    assert 0.0 <= progress < 1.0, f"progress must be in [0, 1), got {progress}"
    lag = lag.to(behaviour.dtype).clamp(min=0)
    a = torch.where(lag > 0, lag / (lag + progress), torch.zeros_like(lag))
    return behaviour + a * (current.detach() - behaviour)


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_eps_clip: Optional[float],
    loss_mask: torch.Tensor,
    loss_fn_type: str = "mse",
    huber_delta: float = 1.0,
) -> Tuple[torch.Tensor, Stats]:
    """Clipped value loss::

        v_clip = old_values + clip(values - old_values, -value_eps_clip, value_eps_clip)
        mse:   f(v) = 0.5 * (v - R)^2
        huber: f(v) = 0.5 * e^2 if |e| <= delta else delta * (|e| - 0.5 * delta),  e = v - R
        loss = mean over the mask of max(f(values), f(v_clip))

    ``value_eps_clip=None`` disables clipping (``loss = mean f(values)``). Stats: ``value_clip_ratio``
    (fraction of masked tokens where the clipped term is the larger one), ``loss``.
    """
    _check_mask(values, loss_mask, "values")
    assert old_values.shape == values.shape and returns.shape == values.shape, (
        f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and returns {tuple(returns.shape)} "
        "must have the same shape"
    )
    returns = returns.detach()
    old_values = old_values.detach()

    if loss_fn_type == "mse":
        f = lambda v: 0.5 * (v - returns) ** 2  # noqa: E731
    elif loss_fn_type == "huber":
        assert huber_delta > 0, f"huber_delta must be > 0, got {huber_delta}"
        f = lambda v: torch.nn.functional.huber_loss(v, returns, reduction="none", delta=huber_delta)  # noqa: E731
    else:
        raise ValueError(f"critic_loss: loss_fn_type must be 'mse' or 'huber', got {loss_fn_type!r}")

    l_orig = f(values)
    if value_eps_clip is None:
        per_tok = l_orig
        clipped = torch.zeros_like(loss_mask)
    else:
        assert value_eps_clip >= 0, f"value_eps_clip must be >= 0, got {value_eps_clip}"
        v_clip = old_values + torch.clamp(values - old_values, -value_eps_clip, value_eps_clip)
        l_clip = f(v_clip)
        per_tok = torch.maximum(l_orig, l_clip)
        clipped = (l_clip > l_orig) & loss_mask
    loss = masked_mean(per_tok, loss_mask)
    n = loss_mask.sum().clamp(min=1).float()
    return loss, {"value_clip_ratio": _stat(clipped.sum() / n), "loss": _stat(loss)}


def entropy_bonus(entropy: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over the mask (differentiable); subtract ``coef * entropy_bonus`` from the loss."""
    _check_mask(entropy, loss_mask, "entropy")
    return masked_mean(entropy, loss_mask)


# ----------------------------------------------------------------------------------------------
# KL estimators, reward shaping, KL controllers
# ----------------------------------------------------------------------------------------------


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


def last_masked_index(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` packed index of each sequence's last True mask entry, -1 for sequences with none."""
    T = loss_mask.numel()
    seq_id, lens = _seq_ids(cu_seqlens, T, loss_mask.device)
    idx = torch.where(loss_mask, torch.arange(T, device=loss_mask.device), torch.full_like(seq_id, -1))
    out = torch.full((lens.numel(),), -1, dtype=torch.long, device=loss_mask.device)
    return out.scatter_reduce(0, seq_id, idx, reduce="amax", include_self=True)


def kl_reward_shaping(
    task_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_ctl: float,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    max_reward_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards for PPO with a KL penalty to a reference policy::

        kl_rewards_t    = -kl_ctl * (logprobs_t - ref_logprobs_t) * mask_t
        token_rewards_t = kl_rewards_t + [t == last masked token of its sequence] * clip(task_reward, +-max_reward_clip)

    ``task_rewards`` has one entry per sequence; ``cu_seqlens`` indexes the per-token tensors. A sequence
    without any masked token receives no task reward (it would not be trained on anyway).
    ``max_reward_clip=None`` leaves task rewards unclipped. Returns ``(token_rewards, kl_rewards)``.
    """
    _check_mask(logprobs, loss_mask, "logprobs")
    n = cu_seqlens.numel() - 1
    assert task_rewards.numel() == n, f"task_rewards has {task_rewards.numel()} entries for {n} sequences"
    kl_rewards = torch.where(loss_mask, -kl_ctl * (logprobs - ref_logprobs), torch.zeros_like(logprobs))
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


# ----------------------------------------------------------------------------------------------
# Sequence-level advantages (GRPO) and masks
# ----------------------------------------------------------------------------------------------


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, std_norm: bool = True
) -> torch.Tensor:
    """GRPO advantages: rewards of consecutive groups of ``group_size`` sequences (answers to one prompt)::

        A_i = (r_i - mean_g) / (std_g + eps)     if std_norm    (std_g: unbiased, Bessel-corrected)
        A_i =  r_i - mean_g                      otherwise      (Dr. GRPO)

    A group whose rewards are all equal (including a group of one) gets exactly 0 advantages.
    """
    rewards = rewards.reshape(-1)
    n = rewards.numel()
    assert group_size >= 1, f"group_size must be >= 1, got {group_size}"
    if n % group_size != 0:
        raise ValueError(
            f"group_normalized_advantages: n_seqs={n} is not a multiple of group_size={group_size}; "
            "each prompt must contribute exactly group_size answers"
        )
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    r = rewards.reshape(n // group_size, group_size).double()
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if std_norm and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def broadcast_sequence_advantages(
    seq_adv: torch.Tensor, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """``[T]`` per-token advantages: each sequence's scalar on its masked tokens, 0 elsewhere."""
    seq_adv = seq_adv.reshape(-1)
    seq_id, lens = _seq_ids(cu_seqlens, loss_mask.numel(), loss_mask.device)
    assert seq_adv.numel() == lens.numel(), f"seq_adv has {seq_adv.numel()} entries for {lens.numel()} sequences"
    tok = seq_adv.to(loss_mask.device)[seq_id]
    return torch.where(loss_mask, tok, torch.zeros_like(tok))


def length_limit_mask(seq_no_eos: torch.Tensor, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``loss_mask`` with every token of the sequences flagged in ``seq_no_eos`` (answers cut by the length
    limit before EOS) turned off."""
    seq_id, lens = _seq_ids(cu_seqlens, loss_mask.numel(), loss_mask.device)
    assert seq_no_eos.numel() == lens.numel(), f"seq_no_eos has {seq_no_eos.numel()} entries for {lens.numel()} sequences"
    return loss_mask & ~seq_no_eos.to(device=loss_mask.device, dtype=torch.bool).reshape(-1)[seq_id]


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------


def _masked_moments(x: torch.Tensor, mask: torch.Tensor, group=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, count) over the mask in float64, summed across ``group``'s ranks if given."""
    xd = torch.where(mask, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device))
    buf = torch.stack([xd.sum(), (xd * xd).sum(), mask.sum().double()])
    if group is not None:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf[0], buf[1], buf[2]


def masked_normalization(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-5,
    unbiased: bool = False,
    all_reduce_group=None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its masked entries::

        mu = sum(x m) / sum(m);  var = sum(x^2 m) / sum(m) - mu^2   (times N/(N-1) if unbiased)
        out = (x - mu) / sqrt(var + eps)  on masked entries, 0 elsewhere

    With ``all_reduce_group`` (a ``torch.distributed`` group, e.g. the data-parallel group), the sums and
    count are all-reduced so every rank normalises with the global statistics. Moments are accumulated
    in float64; the result has ``x``'s dtype.
    """
    _check_mask(x, mask)
    s, sq, cnt = _masked_moments(x, mask, all_reduce_group)
    c = cnt.clamp(min=1.0)
    mean = s / c
    var = (sq / c - mean * mean).clamp(min=0.0)
    if unbiased:
        var = var * c / (c - 1.0).clamp(min=1.0)
    out = (x.double() - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros_like(out)).to(x.dtype)


class ValueNormalizer:
    """Running mean/std of critic targets, for value normalisation (PopArt-style without the output
    layer rescaling): train the critic on ``normalize(returns)``, read values with ``denormalize``.

    ``beta=None``: exact statistics of everything seen (parallel Welford merge).
    ``beta in (0, 1)``: exponential moving averages of E[x] and E[x^2], debiased by ``1 - beta^k``.
    Before the first update ``mean = 0, var = 1``. ``std = sqrt(var + eps)``.
    With ``all_reduce_group``, every ``update`` uses statistics summed over the group's ranks, so all
    ranks keep identical state.
    """

    def __init__(self, beta: Optional[float] = None, eps: float = 1e-5, all_reduce_group=None):
        if beta is not None:
            assert 0.0 < beta < 1.0, f"beta must be in (0, 1) or None, got {beta}"
        self.beta = beta
        self.eps = float(eps)
        self.group = all_reduce_group
        self.mean = 0.0
        self.var = 1.0
        self.count = 0.0  # tokens seen (beta=None) or updates (EMA)
        self._ema_mean = 0.0
        self._ema_sq = 0.0
        self._debias = 0.0

    @torch.no_grad()
    def update(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        if mask is None:
            mask = torch.ones_like(x, dtype=torch.bool)
        _check_mask(x, mask)
        s, sq, cnt = (float(t) for t in _masked_moments(x, mask, self.group))
        if cnt == 0:
            return
        bmean = s / cnt
        bvar = max(sq / cnt - bmean * bmean, 0.0)
        if self.beta is None:
            total = self.count + cnt
            delta = bmean - self.mean
            m2 = self.var * self.count + bvar * cnt + delta * delta * self.count * cnt / total
            self.mean += delta * cnt / total
            self.var = m2 / total
            self.count = total
        else:
            b = self.beta
            self._ema_mean = b * self._ema_mean + (1 - b) * bmean
            self._ema_sq = b * self._ema_sq + (1 - b) * (sq / cnt)
            self._debias = b * self._debias + (1 - b)
            self.mean = self._ema_mean / self._debias
            self.var = max(self._ema_sq / self._debias - self.mean * self.mean, 0.0)
            self.count += 1

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> Dict[str, float]:
        return {
            "mean": self.mean,
            "var": self.var,
            "count": self.count,
            "ema_mean": self._ema_mean,
            "ema_sq": self._ema_sq,
            "debias": self._debias,
        }

    def load_state_dict(self, state: Dict[str, float]) -> None:
        missing = {"mean", "var", "count", "ema_mean", "ema_sq", "debias"} - set(state)
        assert not missing, f"ValueNormalizer state is missing {sorted(missing)}"
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.count = float(state["count"])
        self._ema_mean = float(state["ema_mean"])
        self._ema_sq = float(state["ema_sq"])
        self._debias = float(state["debias"])


RunningMeanStd = ValueNormalizer
