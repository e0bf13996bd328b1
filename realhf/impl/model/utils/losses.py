"""Policy and value losses over packed token tensors.

Every policy loss is one function returning ``(loss, stats)`` (``loss``: a differentiable 0-dim tensor; ``stats``:
detached 0-dim floats) and is built from the same parts:

* a per-token surrogate: PPO's clipped ratio (:func:`actor_loss`) or GSPO's sequence-level ratio (:func:`gspo_loss`),
  with asymmetric clipping (DAPO's clip-higher: ``eps_clip_higher``);
* an optional behaviour importance weight (:func:`behaviour_weights`) between the policy the samples came from and
  a proximal policy the trust region is centred on: AReaL's decoupled PPO, and the train-inference mismatch
  corrections TIS (truncated) and MIS (masked);
* an aggregation of the per-token losses into one number (:func:`aggregate_loss`): a token mean (DAPO's token-level
  loss), a mean over answers of each answer's token mean (GRPO, GSPO), or a token sum over a constant (Dr. GRPO).

Masks and sequence ids follow :mod:`realhf.impl.model.utils.masked`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from realhf.impl.model.utils.masked import Stats, check_mask, masked_mean, per_seq_sum, stat

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BEHAV_WEIGHT_MODES = ("mask", "truncate")
GSPO_MAX_LOG_RATIO = 10.0  # the sequence log-ratio is capped here (as veRL does) so that exp() stays finite


# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------


def _compact(seq_of_token: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Sequence labels of the tokens as ``0 .. n-1`` and ``n``."""
    uniq, inv = torch.unique(seq_of_token, return_inverse=True)
    return inv, int(uniq.numel())


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   seq_of_token: Optional[torch.Tensor] = None, norm_const: Optional[float] = None) -> torch.Tensor:
    """One loss from per-token losses ``l_t`` over the masked tokens; the answers are the sequences of
    ``seq_of_token`` (the sequence of every token) that have a masked token, ``|y_i|`` their masked tokens::

        token-mean               sum_t l_t / sum_i |y_i|                       (DAPO's token-level loss)
        seq-mean-token-mean      1/G * sum_i (1/|y_i|) sum_{t in y_i} l_t     (GRPO's and GSPO's objective)
        seq-mean-token-sum-norm  1/G * sum_i (1/C) sum_{t in y_i} l_t         (Dr. GRPO; C = norm_const)

    ``G`` is the number of answers. An empty mask gives 0."""
    check_mask(per_token, mask, "per_token")
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss aggregation {mode!r} is not known; choose one of {list(LOSS_AGG_MODES)}")
    assert seq_of_token is not None and seq_of_token.shape == per_token.shape, (
        f"loss aggregation {mode!r} needs the sequence of every token (seq_of_token, shape {tuple(per_token.shape)})")
    ids, n = _compact(seq_of_token)
    count = per_seq_sum(mask.to(per_token.dtype), mask, ids, n)
    present = count > 0
    g = present.sum().clamp(min=1).to(per_token.dtype)
    sums = per_seq_sum(per_token, mask, ids, n)
    if mode == "seq-mean-token-mean":
        return torch.where(present, sums / count.clamp(min=1), torch.zeros_like(sums)).sum() / g
    assert norm_const is not None and norm_const > 0, f"{mode} needs a positive norm_const, got {norm_const}"
    return sums.sum() / (g * float(norm_const))


def loss_weight(mask: torch.Tensor, mode: str = "token-mean", seq_of_token: Optional[torch.Tensor] = None) -> float:
    """What one micro-batch's loss is weighted by when micro-batches are combined, so that the whole batch's loss is
    :func:`aggregate_loss` of the whole batch: its masked tokens (token-mean) or its answers with a masked token."""
    if mode == "token-mean":
        return float(mask.sum())
    ids, n = _compact(seq_of_token)
    return float((per_seq_sum(mask.double(), mask, ids, n) > 0).sum())


# ----------------------------------------------------------------------------------------------
# Behaviour importance weights
# ----------------------------------------------------------------------------------------------


def behaviour_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                      cap: Optional[float] = None, mode: str = "mask") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token importance weights ``w = exp(proximal - behaviour)`` (constants of the loss) of samples drawn from a
    behaviour policy (the generator: an older version, or an engine whose numerics differ) for a loss whose trust
    region is centred on a proximal policy (the trainer's). With a ``cap`` C::

        mode "mask"      w stays, tokens with w > C leave the loss            (MIS; AReaL's behav_imp_weight_cap)
        mode "truncate"  w := min(w, C), every token stays                     (TIS, Yao et al. 2025)

    Returns ``(w, kept, capped)``: the weights, the tokens that stay in the loss, the tokens above the cap."""
    if mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"behaviour weight mode {mode!r} is not known; choose one of {list(BEHAV_WEIGHT_MODES)}")
    zero = torch.zeros_like(proximal_logprobs)
    w = torch.exp(torch.where(loss_mask, proximal_logprobs - behaviour_logprobs, zero)).detach()
    capped = torch.zeros_like(loss_mask)
    if cap is not None:
        assert cap > 0, f"the behaviour importance weight cap must be > 0, got {cap}"
        capped = (w > cap) & loss_mask
        if mode == "truncate":
            w = w.clamp(max=cap)
    kept = loss_mask & ~capped if mode == "mask" else loss_mask
    return w, kept, capped


# ----------------------------------------------------------------------------------------------
# Policy losses
# ----------------------------------------------------------------------------------------------


def _clip_bounds(eps_clip: float, eps_clip_higher: Optional[float]) -> Tuple[float, float]:
    assert eps_clip >= 0, f"eps_clip must be >= 0, got {eps_clip}"
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    assert hi >= 0, f"eps_clip_higher must be >= 0, got {hi}"
    return 1.0 - eps_clip, 1.0 + hi


def _check_shapes(logprobs, old_logprobs, advantages, loss_mask) -> None:
    check_mask(logprobs, loss_mask, "logprobs")
    assert old_logprobs.shape == logprobs.shape and advantages.shape == logprobs.shape, (
        f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and advantages "
        f"{tuple(advantages.shape)} must have the same shape")


def _finish(pg: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, dual: torch.Tensor, logprobs, base,
            old_logprobs, proximal_logprobs, loss_mask, cap, weight_mode, agg_mode, seq_of_token,
            norm_const) -> Tuple[torch.Tensor, Stats]:
    """Behaviour weights, aggregation and the stats shared by the policy losses."""
    n = loss_mask.sum().clamp(min=1).float()
    if proximal_logprobs is not None:
        w, kept, capped = behaviour_weights(proximal_logprobs, old_logprobs, loss_mask, cap, weight_mode)
        pg = pg * w
        diff = masked_mean((proximal_logprobs - old_logprobs).abs(), loss_mask)
    else:
        w, kept, capped = torch.ones_like(logprobs), loss_mask, torch.zeros_like(loss_mask)
        diff = torch.zeros((), device=logprobs.device)
    loss = aggregate_loss(torch.where(kept, pg, torch.zeros_like(pg)), kept, agg_mode, seq_of_token, norm_const)
    stats = {
        "importance_weight": stat(masked_mean(ratio, loss_mask)),
        "clip_ratio": stat(clipped.sum() / n),
        "dual_clip_ratio": stat(dual.sum() / n),
        "approx_kl": stat(masked_mean(base - logprobs, loss_mask)),
        "behave_imp_weight": stat(masked_mean(w, loss_mask)),
        "behave_capped_ratio": stat(capped.sum() / n),
        "behave_logp_abs_diff": stat(diff),
        "loss": stat(loss),
    }
    return loss, stats


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    c_clip: Optional[float] = None,
    proximal_logprobs: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    *,
    eps_clip_higher: Optional[float] = None,
    behav_imp_weight_mode: str = "mask",
    loss_agg_mode: str = "token-mean",
    seq_of_token: Optional[torch.Tensor] = None,
    loss_norm_const: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate loss (Schulman et al. 2017), optionally with clip-higher, dual clipping and a decoupled
    proximal policy.

    Per token, with ``r = exp(logprobs - base)`` where ``base = old_logprobs`` (or ``proximal_logprobs``)::

        l_1 = -A * r
        l_2 = -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher)        (eps_clip_higher: DAPO's clip-higher; default eps_clip)
        l   = max(l_1, l_2)                                           standard PPO clip
        l   = min(l, -c_clip * A)       where A < 0                   dual clip (Ye et al. 2020), c_clip > 1
        loss = aggregate over the kept tokens of  w * l               (:func:`aggregate_loss`, token mean by default)

    ``w = 1`` normally. With ``proximal_logprobs`` ``w`` is the behaviour importance weight of
    :func:`behaviour_weights` (``behav_imp_weight_cap``, ``behav_imp_weight_mode``): decoupled PPO, as in AReaL's
    asynchronous RL (samples from a stale behaviour policy ``old``, trust region around a recent proximal policy),
    and the train-inference mismatch corrections TIS/MIS (samples from the generator, proximal = the trainer's
    log-probs of the same parameters).

    Stats (means over the mask): ``importance_weight`` (mean ``r``), ``clip_ratio`` (fraction of tokens where the
    clipped branch is active, ``l_2 > l_1``), ``dual_clip_ratio``, ``approx_kl`` = mean(``base - logprobs``) (k1
    estimate of KL(pi_base || pi_theta), 0 at the first PPO minibatch), ``behave_imp_weight`` (mean ``w``),
    ``behave_capped_ratio`` (fraction above the cap), ``behave_logp_abs_diff`` (mean ``|proximal - old|``), ``loss``.
    """
    _check_shapes(logprobs, old_logprobs, advantages, loss_mask)
    if c_clip is not None:
        assert c_clip > 1.0, f"c_clip (dual clip) must be > 1, got {c_clip}"
    lo, hi = _clip_bounds(eps_clip, eps_clip_higher)
    base = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    advantages = advantages.detach()
    ratio = torch.exp(torch.where(loss_mask, logprobs - base, torch.zeros_like(logprobs)))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, lo, hi)
    pg = torch.maximum(l1, l2)
    clipped = (l2 > l1) & loss_mask
    dual = torch.zeros_like(loss_mask)
    if c_clip is not None:
        l3 = -c_clip * advantages
        dual = (advantages < 0) & (l3 < pg) & loss_mask
        pg = torch.where(dual, l3, pg)
    return _finish(pg, ratio, clipped, dual, logprobs, base, old_logprobs, proximal_logprobs, loss_mask,
                   behav_imp_weight_cap, behav_imp_weight_mode, loss_agg_mode, seq_of_token, loss_norm_const)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    seq_of_token: torch.Tensor,
    proximal_logprobs: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    *,
    eps_clip_higher: Optional[float] = None,
    behav_imp_weight_mode: str = "mask",
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_norm_const: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per answer, the geometric
    mean of its token ratios, clipped per answer::

        s_i  = exp( 1/|y_i| * sum_t (logprobs_t - base_t) )           (base: old_logprobs, or proximal_logprobs)
        l_i  = max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_clip, 1 + eps_clip_higher))
        loss = 1/G * sum_i l_i

    It is computed in the token form of the paper (GSPO-token): per token ``s_{i,t} = sg[s_i] * exp(logprobs_t -
    sg[logprobs_t])``, whose value is ``s_i`` and whose gradient, averaged over the answer's tokens, is that of
    ``s_i``; the per-token losses are aggregated per answer (``seq-mean-token-mean``), which gives ``1/G sum_i l_i``
    for sequence-level advantages. ``s_i``'s log is capped at 10. ``seq_of_token``: the sequence of every token.
    Behaviour weights and stats as in :func:`actor_loss` (``clip_ratio``: the fraction of tokens of clipped answers).
    """
    _check_shapes(logprobs, old_logprobs, advantages, loss_mask)
    assert seq_of_token is not None and seq_of_token.shape == logprobs.shape, (
        f"gspo_loss needs the sequence of every token (seq_of_token, shape {tuple(logprobs.shape)})")
    lo, hi = _clip_bounds(eps_clip, eps_clip_higher)
    base = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    advantages = advantages.detach()
    ids, n = _compact(seq_of_token)
    d = torch.where(loss_mask, logprobs - base, torch.zeros_like(logprobs)).detach()
    count = per_seq_sum(loss_mask.to(d.dtype), loss_mask, ids, n).clamp(min=1)
    seq_log_ratio = per_seq_sum(d, loss_mask, ids, n) / count
    log_s = (logprobs - logprobs.detach() + seq_log_ratio[ids]).clamp(max=GSPO_MAX_LOG_RATIO)
    s = torch.exp(torch.where(loss_mask, log_s, torch.zeros_like(log_s)))
    l1 = -advantages * s
    l2 = -advantages * torch.clamp(s, lo, hi)
    pg = torch.maximum(l1, l2)
    clipped = (l2 > l1) & loss_mask
    return _finish(pg, s, clipped, torch.zeros_like(loss_mask), logprobs, base, old_logprobs, proximal_logprobs,
                   loss_mask, behav_imp_weight_cap, behav_imp_weight_mode, loss_agg_mode, seq_of_token,
                   loss_norm_const)


POLICY_LOSSES = {"ppo": actor_loss, "gspo": gspo_loss}


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


# ----------------------------------------------------------------------------------------------
# Value loss and entropy
# ----------------------------------------------------------------------------------------------


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
    check_mask(values, loss_mask, "values")
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
    return loss, {"value_clip_ratio": stat(clipped.sum() / n), "loss": stat(loss)}


def entropy_bonus(entropy: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over the mask (differentiable); subtract ``coef * entropy_bonus`` from the loss."""
    check_mask(entropy, loss_mask, "entropy")
    return masked_mean(entropy, loss_mask)

