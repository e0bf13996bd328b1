"""PPO / GRPO actor and critic interfaces.

Per-token tensors are aligned with ``packed_input_ids``: entry ``t`` of a sequence scores token ``t+1``
(the last entry of each sequence is unused). The loss mask is True where token ``t+1`` is an answer
token. Data a step sees (one sample = one prompt with its ``group_size`` answers):
``packed_input_ids``, ``packed_logprobs`` (behaviour policy, from generation), ``prompt_mask``,
``seq_no_eos_mask``, ``rewards`` (one per answer), optionally ``packed_ref_logprobs`` and ``values``.

* Critic-free (GRPO): advantages are the group-normalised task rewards, the same on every answer token.
* With a critic (PPO): per-token rewards = KL penalty + task reward at the last answer token, GAE with
  the critic's values; returns train the critic (clipped value loss, optional value normalisation).

Both interfaces take the experiment's ``ppo`` section (:class:`PPOHyperparameters`, as the CLI validated it)
and read every option from it; the actor also takes the experiment-level ``group_size`` (answers per
prompt), ``use_critic`` and ``seed``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, register_interface
from realhf.api.quickstart.ppo_config import PPOHyperparameters
from realhf.base import logging
from realhf.base.stats_tracker import StatsTracker
from realhf.impl.model.interface.gen_interface import GenerationInterface
from realhf.impl.model.utils import ppo_functional as F
from realhf.impl.model.utils.functional import answer_loss_mask as answer_mask
from realhf.impl.model.utils.functional import logprobs_at, packed_logprobs
from realhf.impl.model.utils.gae import gae_packed

logger = logging.getLogger(__name__)


def answer_loss_mask(sample: SequenceSample) -> torch.Tensor:
    return answer_mask(sample.data["prompt_mask"], sample.cu_seqlens("packed_input_ids"))


def _per_token(sample: SequenceSample, tensors: Dict[str, torch.Tensor]) -> SequenceSample:
    """``sample`` plus per-token float keys aligned with packed_input_ids."""
    seqlens = sample.seqlens["packed_input_ids"]
    extra = SequenceSample(
        keys=set(tensors), ids=list(sample.ids), seqlens={k: seqlens for k in tensors},
        trailing_shapes={k: () for k in tensors}, dtypes={k: v.dtype for k, v in tensors.items()}, data=dict(tensors),
    )
    out = SequenceSample(keys=set(sample.keys), ids=list(sample.ids), seqlens=dict(sample.seqlens),
                         trailing_shapes=dict(sample.trailing_shapes), dtypes=dict(sample.dtypes),
                         data=dict(sample.data), metadata=dict(sample.metadata))
    out.update_(extra)
    return out


# the policy loss's stats, logged as (name in the step's stats: name in the loss's stats)
LOSS_STATS = {"actor_loss": "loss", "importance_weight": "importance_weight", "actor_clip_ratio": "clip_ratio",
              "ppo_approx_kl": "approx_kl", "behave_imp_weight": "behave_imp_weight",
              "behave_capped_ratio": "behave_capped_ratio", "behave_logp_abs_diff": "behave_logp_abs_diff"}


def loss_rows(mb: SequenceSample) -> torch.Tensor:
    """The packed positions of ``mb`` in the loss (their next token is a trained answer token): the output head runs
    on these rows only."""
    return mb.data["loss_mask"].nonzero().squeeze(-1)


def answer_of_rows(mb: SequenceSample, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """The answer (sequence of ``mb``) of every packed position in ``rows`` (None: of every position)."""
    cu = mb.cu_seqlens("packed_input_ids")
    sid, _ = F.seq_ids(cu, int(cu[-1]), mb.data["loss_mask"].device)
    return sid if rows is None else sid[rows.to(sid.device)]


def _nonzero_advantage_samples(sample: SequenceSample, grid, device) -> Tuple[Optional[List[int]], Dict[str, float]]:
    """Indices of the samples (a prompt and its answers) of ``sample`` with an answer whose advantage is nonzero at
    some loss token (with no KL loss or entropy bonus the others add nothing to the policy gradient: the clipped PPO
    loss of a zero advantage is 0), and ``actor_kept_frac``, the fraction of samples kept over all data-parallel
    ranks. ``None`` when no rank keeps any (the step makes no update). A rank that keeps none while others keep some
    keeps its shortest sample, whose gradient is 0, so that every rank runs the same collectives."""
    lens = [sum(x) for x in sample.seqlens["packed_input_ids"]]
    signal = ((sample.data["advantages"] != 0) & sample.data["loss_mask"].bool()).split(lens)
    keep = [i for i, x in enumerate(signal) if bool(x.any())]
    t = torch.tensor([len(keep), len(lens)], dtype=torch.float64, device=device)
    if grid is not None and grid.dp_group is not None:
        dist.all_reduce(t, group=grid.dp_group)
    stats = {"actor_kept_frac": float(t[0]) / max(float(t[1]), 1.0)}
    if float(t[0]) == 0:
        return None, stats
    if not keep:
        keep = [min(range(len(lens)), key=lambda i: lens[i])]
    return keep, stats


def _keep_nonzero_advantage(sample: SequenceSample, grid, device) -> Tuple[Optional[SequenceSample], Dict[str, float]]:
    """The samples of :func:`_nonzero_advantage_samples` (None: no rank keeps any) and its stats."""
    keep, stats = _nonzero_advantage_samples(sample, grid, device)
    if keep is None:
        return None, stats
    return (sample if len(keep) == sample.bs else sample.take(keep)), stats


def n_minibatches(requested: int, local_bs: int, grid, device) -> int:
    """Minibatches per step, identical on every data-parallel rank (each needs >= 1 sample per minibatch):
    every rank must run the same number of optimizer steps, or their collectives would not match."""
    t = torch.tensor([min(requested, local_bs)], dtype=torch.long, device=device)
    if grid is not None and grid.dp_group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=grid.dp_group)
    return int(t)


def _dp_reduce(means: Dict[str, float], sums: Dict[str, float], count: int, grid, device) -> Dict[str, float]:
    """In one all-reduce over the data-parallel ranks: the sample-weighted means of per-rank ``means`` (each rank
    holds ``count`` samples), the totals of ``sums``, and ``n_seqs``, the number of samples."""
    mk, sk = sorted(means), sorted(sums)
    t = torch.tensor([means[k] * count for k in mk] + [sums[k] for k in sk] + [count], dtype=torch.float64,
                     device=device)
    if grid is not None and grid.dp_group is not None:
        dist.all_reduce(t, group=grid.dp_group)
    vals, total = t.tolist(), max(float(t[-1]), 1.0)
    out = {k: v / total for k, v in zip(mk, vals)}
    out.update(zip(sk, vals[len(mk):-1]))
    out["n_seqs"] = vals[-1]
    return out


def compute_advantages(sample: SequenceSample, cfg: PPOHyperparameters, grid, use_critic: bool, group_size: int,
                       normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(loss_mask, advantages, returns) per token, and stats. Same on every rank of a dp group. Advantages are
    normalised over the batch when ``cfg.adv_norm`` and ``normalize`` (the critic, which uses only the returns,
    skips it)."""
    mask = answer_loss_mask(sample)
    cu = sample.cu_seqlens("packed_input_ids")
    no_eos = sample.data["seq_no_eos_mask"].bool()
    if cfg.mask_too_long:
        mask = F.length_limit_mask(no_eos, cu, mask)
    rewards = sample.data["rewards"].float().reshape(-1)
    stats = {}
    if cfg.overlong_tokens > 0:  # DAPO's overlong reward shaping
        penalty = F.overlong_penalty(answer_lengths(sample), cfg.gen.max_new_tokens, cfg.overlong_tokens,
                                     cfg.overlong_penalty_factor).to(rewards.device)
        rewards = rewards + penalty
        stats["overlong_penalty"] = float(penalty.mean())
    old_lp = sample.data["packed_logprobs"].float()
    ref_lp = sample.data.get("packed_ref_logprobs")
    kl_on = ref_lp is not None and cfg.kl_ctl > 0
    # with kl_ctl = 0: the task reward alone, at the last answer token
    token_rewards, kl_rewards = F.kl_reward_shaping(rewards, old_lp, ref_lp.float() if kl_on else old_lp,
                                                    cfg.kl_ctl if kl_on else 0.0, cu, mask, cfg.max_reward_clip,
                                                    estimator=cfg.kl_estimator)
    n_valid = float(mask.sum())
    stats["kl_reward"] = float((kl_rewards * mask).sum()) / max(n_valid, 1.0)
    stats["final_reward"] = float((token_rewards * mask).sum()) / max(1, rewards.numel())
    if use_critic:
        adv, ret = _gae_advantages(sample, cfg, token_rewards, cu, no_eos)
    else:
        adv = critic_free_advantages(cfg, rewards, token_rewards, kl_rewards if kl_on else None, cu, mask, group_size)
        ret = torch.zeros_like(old_lp)
    if cfg.adv_norm and normalize:
        adv = F.masked_normalization(adv, mask, all_reduce_group=grid.dp_group if grid is not None else None)
    stats["advantage"] = float((adv * mask).sum()) / max(n_valid, 1.0)
    return mask, adv * mask, ret, stats


def answer_lengths(sample: SequenceSample) -> torch.Tensor:
    """``[n]``: the answer (non-prompt) tokens of every sequence."""
    pm = sample.data["prompt_mask"].bool()
    sid, lens = F.seq_ids(sample.cu_seqlens("packed_input_ids"), pm.numel(), pm.device)
    return F.per_seq_sum((~pm).float(), torch.ones_like(pm), sid, lens.numel())


def critic_free_advantages(cfg: PPOHyperparameters, rewards: torch.Tensor, token_rewards: torch.Tensor,
                           kl_rewards: Optional[torch.Tensor], cu: torch.Tensor, mask: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """Per-token advantages without a critic, by ``cfg.adv_estimator``. ``kl_rewards`` (the per-token KL penalty,
    when ``kl_ctl`` > 0): REINFORCE++ sums the token rewards from each token on; the group estimators lower each
    answer's reward by its summed KL penalty before the baseline (as veRL does with a KL-shaped reward)."""
    if cfg.adv_estimator == "reinforce++":
        return F.reinforce_returns(token_rewards, cu, mask, cfg.discount)
    score = rewards
    if kl_rewards is not None:
        sid, lens = F.seq_ids(cu, mask.numel(), mask.device)
        score = rewards + F.per_seq_sum(kl_rewards, mask, sid, lens.numel()).to(rewards.dtype)
    if cfg.adv_estimator == "rloo":
        seq_adv = F.rloo_advantages(score, group_size)
    elif group_size > 1:
        seq_adv = F.group_normalized_advantages(score, group_size, std_norm=cfg.group_adv_norm)
    else:
        seq_adv = score - score.mean()
    return F.broadcast_sequence_advantages(seq_adv, cu, mask)


def _gae_advantages(sample: SequenceSample, cfg: PPOHyperparameters, token_rewards: torch.Tensor, cu: torch.Tensor,
                    no_eos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) per token by GAE with the critic's ``values``."""
    values = sample.data["values"].float()
    # GAE over answer positions: rewards at t in [P-1, L-2], values at t in [P-1, L-1] (bootstrap last)
    r_list, v_list, seg = [], [], []
    lens = (cu[1:] - cu[:-1]).tolist()
    pm = sample.data["prompt_mask"].bool()
    for i, (s, L) in enumerate(zip(cu[:-1].tolist(), lens)):
        P = int(pm[s : s + L].sum())
        a, b = s + P - 1, s + L - 1
        r_list.append(token_rewards[a:b])
        v_list.append(values[a : b + 1])
        seg.append((a, b))
    seqlens = torch.tensor([b - a for a, b in seg])
    gcu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    gcu[1:] = torch.cumsum(seqlens, 0)
    adv_s, ret_s = gae_packed(torch.cat(r_list), torch.cat(v_list), gcu, no_eos, cfg.discount, cfg.gae_lambda)
    adv = torch.zeros_like(token_rewards)
    ret = torch.zeros_like(token_rewards)
    for (a, b), lo, hi in zip(seg, gcu[:-1].tolist(), gcu[1:].tolist()):
        adv[a:b] = adv_s[lo:hi]
        ret[a:b] = ret_s[lo:hi]
    return adv, ret


def version_lag_stats(data: SequenceSample, version: int, grid, device) -> Dict[str, float]:
    """How stale the trained answers are: per answer, ``version`` (the parameters being trained) minus the oldest
    weight version behind any of its generated tokens; ``version_lag_max`` / ``version_lag_mean`` over the batch
    (every data-parallel rank), and ``version_spread_mean``: newest minus oldest version within an answer (> 0
    when a weight update landed while it was generated)."""
    vers = data.data["packed_versions"].long()
    gen = ~data.data["prompt_mask"].bool()
    lags, spreads = [], []
    off = 0
    for n in data.flat_seqlens("packed_versions"):
        v = vers[off : off + n][gen[off : off + n]]
        off += n
        if v.numel():
            lags.append(version - int(v.min()))
            spreads.append(int(v.max()) - int(v.min()))
    t = torch.tensor([float(sum(lags)), float(sum(spreads)), float(len(lags))], dtype=torch.float64, device=device)
    mx = torch.tensor([float(max(lags, default=0))], dtype=torch.float64, device=device)
    if grid is not None and grid.dp_group is not None:
        dist.all_reduce(t, group=grid.dp_group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=grid.dp_group)
    n = max(float(t[2]), 1.0)
    return {"version_lag_max": float(mx[0]), "version_lag_mean": float(t[0]) / n, "version_spread_mean": float(t[1]) / n}


class PPOActorInterface(GenerationInterface):
    """generate (from GenerationInterface: ``group_size`` answers per prompt sampled as ``ppo.gen`` says),
    inference (log-probs, e.g. as the reference) and train_step."""

    def __init__(self, ppo: PPOHyperparameters, *, group_size: int, use_critic: bool, seed: int,
                 prox_logp: str = "recompute", proximal: bool = False):
        super().__init__(gconfig=ppo.gen.to_hyperparameters(n=group_size), seed=seed)
        self.cfg = ppo
        self.group_size = group_size
        self.use_critic = use_critic
        # decoupled PPO's proximal log-probs: "recompute" (the proximal_logprobs key, when actor_inf made it) or
        # "loglinear" (interpolated per token from the behaviour log-probs and packed_versions, no forward pass)
        if prox_logp not in ("recompute", "loglinear"):
            raise ValueError(f"prox_logp={prox_logp!r} is not allowed; allowed: recompute, loglinear")
        self.prox_logp = prox_logp
        # this instance recomputes the proximal log-probs (actor_inf): with ppo.skip_zero_advantage it computes them
        # only for the samples actor_train will train (see inference)
        self.proximal = proximal

    @property
    def temperature(self) -> float:
        """The temperature of the log-probs: the sampling temperature (1 for greedy decoding)."""
        return 1.0 if self.gconfig.greedy else self.gconfig.temperature

    def _trained_samples(self, model: Model, data: SequenceSample) -> Optional[List[int]]:
        """For the proximal log-probs (actor_inf) under ``ppo.skip_zero_advantage``: the indices of the samples that
        actor_train will train, found as train_step finds them (same advantages, same rule), or None where every
        sample is needed (the advantages depend on inputs this MFC does not have: a critic's values, KL-shaped
        rewards)."""
        cfg = self.cfg
        if not (self.proximal and cfg.skip_zero_advantage) or self.use_critic or cfg.kl_ctl > 0:
            return None
        mask, adv, _, _ = compute_advantages(data, cfg, model.grid, self.use_critic, self.group_size)
        keep, _ = _nonzero_advantage_samples(_per_token(data, {"advantages": adv.float(), "loss_mask": mask}),
                                             model.grid, model.module.device)
        return [] if keep is None else keep

    @torch.no_grad()
    def inference(self, model: Model, data: SequenceSample, mb_spec) -> SequenceSample:
        keep = self._trained_samples(model, data)
        if keep is not None and len(keep) < data.bs:
            # log-probs of the trained samples only; the others (never trained) get zeros
            lens = [sum(x) for x in data.seqlens["packed_input_ids"]]
            part = self._inference(model, data.take(keep), mb_spec) if keep else None
            if not model.module.is_last:  # only the last pipeline stage answers (as engine.forward)
                return None
            dev = part.data["logprobs"].device if part is not None else model.module.device
            chunks = [torch.zeros(n, dtype=torch.float32, device=dev) for n in lens]
            if part is not None:
                for i, c in zip(keep, part.data["logprobs"].split([lens[i] for i in keep])):
                    chunks[i] = c
            lp = torch.cat(chunks)
            return SequenceSample(keys={"logprobs"}, ids=list(data.ids), seqlens={"logprobs": data.seqlens["packed_input_ids"]},
                                  trailing_shapes={"logprobs": ()}, dtypes={"logprobs": torch.float32},
                                  data={"logprobs": lp})
        return self._inference(model, data, mb_spec)

    def _inference(self, model: Model, data: SequenceSample, mb_spec) -> Optional[SequenceSample]:
        tp = model.module.tp_group
        temp = self.temperature

        if "prompt_mask" not in data.keys:  # every position
            def post(out, mb):
                return packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids"), tp, temp)[0]

            rows_fn = None
        else:  # only the positions whose next token is an answer token (others are 0): the head and the
            # log-softmax skip the prompt, as nothing uses log-probs of prompt tokens
            def rows_fn(mb):
                return answer_loss_mask(mb).nonzero().squeeze(-1)

            def post(out, mb):
                ids = mb.data["packed_input_ids"]
                rows = rows_fn(mb)
                lp = torch.zeros(ids.numel(), dtype=torch.float32, device=out.device)
                lp[rows.to(out.device)] = logprobs_at(out, ids, rows, tp, temp).float()
                return lp

        res = model.engine.forward(data, max_tokens_per_mb=mb_spec.max_tokens_per_mb, post_fn=post,
                                   head_rows_fn=rows_fn, n_mbs=mb_spec.n_mbs, defer_head=True)
        if res is None:
            return None
        lp = torch.cat(res).float()
        seqlens = data.seqlens["packed_input_ids"]
        return SequenceSample(keys={"logprobs"}, ids=list(data.ids), seqlens={"logprobs": seqlens},
                              trailing_shapes={"logprobs": ()}, dtypes={"logprobs": torch.float32}, data={"logprobs": lp})

    def _loss_fn(self, model: Model, use_ref: bool, loglinear: bool, progress: List[float]):
        """The loss of one micro-batch (the policy loss of ``ppo.policy_loss``, the entropy bonus, the KL loss term,
        aggregated by ``ppo.loss_agg_mode``) and its stats (means over its loss tokens). The output head runs only on
        the loss rows (:func:`loss_rows`)."""
        cfg, tp, temp = self.cfg, model.module.tp_group, self.temperature
        agg, norm_const = cfg.loss_aggregation(), float(cfg.gen.max_new_tokens)
        cap, weight_mode = cfg.behaviour_weight()
        policy_loss = F.POLICY_LOSSES[cfg.policy_loss]
        kw = dict(proximal_logprobs=None, behav_imp_weight_cap=cap, eps_clip_higher=cfg.eps_clip_higher,
                  behav_imp_weight_mode=weight_mode, loss_agg_mode=agg, loss_norm_const=norm_const)
        if cfg.policy_loss == "ppo":
            kw["c_clip"] = cfg.c_clip

        def loss_fn(out, mb):
            rows = loss_rows(mb)
            want_ent = cfg.entropy_coef > 0
            lp = logprobs_at(out, mb.data["packed_input_ids"], rows, tp, temp, entropy=want_ent)
            if want_ent:
                lp, ent = lp
            m = torch.ones_like(lp, dtype=torch.bool)
            sid = answer_of_rows(mb, rows).to(lp.device)
            at = {k: mb.data[k][rows].float().to(lp.device)
                  for k in ("packed_logprobs", "advantages", "packed_ref_logprobs", "proximal_logprobs") if k in mb.data}
            # decoupled PPO when actor_inf recomputed the proximal log-probs (asynchronous runs, or the mismatch
            # correction), or interpolated here (asynchronous runs)
            prox = at.get("proximal_logprobs")
            if loglinear:
                # version of the token each loss row predicts: packed_versions is aligned with the tokens, the
                # log-probs with the position before them
                lag = model.version - mb.data["packed_versions"][rows.to(mb.data["packed_versions"].device) + 1]
                prox = F.loglinear_proximal_logprobs(at["packed_logprobs"], lp, lag.to(lp.device), progress[0])
            loss, st = policy_loss(lp, at["packed_logprobs"], at["advantages"], cfg.eps_clip, m, seq_of_token=sid,
                                   **dict(kw, proximal_logprobs=prox))
            if want_ent:
                loss = loss - cfg.entropy_coef * F.aggregate_loss(ent, m, agg, sid, norm_const)
            if use_ref:
                kl = F.kl_estimator(cfg.kl_loss_estimator)(lp, at["packed_ref_logprobs"])
                loss = loss + cfg.kl_loss_coef * F.aggregate_loss(kl, m, agg, sid, norm_const)
            stats = StatsTracker()
            for k, s in LOSS_STATS.items():
                stats.mean(k, st[s], weight=m.sum())
            return loss, stats

        def weight_fn(mb):
            m = mb.data["loss_mask"].bool()
            return F.loss_weight(m, agg, None if agg == "token-mean" else answer_of_rows(mb, None))

        return loss_fn, weight_fn

    def train_step(self, model: Model, data: SequenceSample, mb_spec) -> Dict[str, float]:
        cfg, grid = self.cfg, model.grid
        mask, adv, _, adv_stats = compute_advantages(data, cfg, grid, self.use_critic, self.group_size)
        sample = _per_token(data, {"advantages": adv.float(), "loss_mask": mask})
        use_ref = cfg.kl_loss_coef > 0 and "packed_ref_logprobs" in sample.keys
        kept_stats = {}
        if cfg.skip_zero_advantage:
            sample, kept_stats = _keep_nonzero_advantage(sample, grid, model.module.device)
        loglinear = self.prox_logp == "loglinear"
        if loglinear and "packed_versions" not in data.keys:
            raise ValueError("prox_logp=loglinear needs packed_versions (the weight version of every generated token): "
                             "train on trajectories from generation servers (async-ppo-math)")
        progress = [0.0]  # m / M at the m-th of the step's M optimizer updates (loglinear proximal log-probs)
        loss_fn, weight_fn = self._loss_fn(model, use_ref, loglinear, progress)
        tracker, grad_norms = StatsTracker(), []
        # no sample (skip_zero_advantage, and no answer on any rank has an advantage): no update on any rank
        parts = [] if sample is None else sample.split(n_minibatches(cfg.ppo_n_minibatches, sample.bs, grid,
                                                                      model.module.device))
        for i, part in enumerate(parts):
            progress[0] = i / len(parts)
            st = model.engine.train_batch(part, loss_fn, weight_fn, max_tokens_per_mb=mb_spec.max_tokens_per_mb,
                                          n_mbs=mb_spec.n_mbs, head_rows_fn=loss_rows, defer_head=True)
            grad_norms.append(st.grad_norm)
            tracker.merge(st.stats)
        means = tracker.export()
        keys = ["actor_loss", "importance_weight", "actor_clip_ratio", "ppo_approx_kl"]
        if "proximal_logprobs" in data.keys or loglinear:
            keys += ["behave_imp_weight", "behave_capped_ratio", "behave_logp_abs_diff"]
        stats = {k: means.get(k, 0.0) for k in keys}
        stats["actor_grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        stats.update(kept_stats)
        stats.update(self._batch_stats(model, data, mask, adv_stats))
        return stats

    def _batch_stats(self, model: Model, data: SequenceSample, mask: torch.Tensor, adv_stats: dict) -> Dict[str, float]:
        """Statistics of the trained batch (data-parallel averages), its versions, the learning rate."""
        grid = model.grid
        lens = data.flat_seqlens("packed_input_ids")
        n = len(lens)
        n_prompt = float(data.data["prompt_mask"].float().sum())
        rewards = data.data["rewards"].float()
        out = _dp_reduce({"task_reward": float(rewards.mean()), "task_reward_sq": float(rewards.pow(2).mean()),
                          "avg_seq_len": sum(lens) / n, "avg_prompt_len": n_prompt / n,
                          "no_eos_ratio": float(data.data["seq_no_eos_mask"].float().mean()), **adv_stats},
                         {"n_tokens": float(sum(lens)), "n_valid_tokens": float(mask.sum())}, n, grid, model.module.device)
        # the spread of the rewards over the whole batch (0: every answer got the same reward)
        out["task_reward_std"] = max(out.pop("task_reward_sq") - out["task_reward"] ** 2, 0.0) ** 0.5
        stats = dict(out)
        if "packed_versions" in data.keys:
            stats.update(version_lag_stats(data, model.version, grid, model.module.device))
        stats["actor_lr"] = model.engine.optimizer.param_groups[0]["lr"]
        stats["actor_skipped_nonfinite"] = float(model.engine.skipped_nonfinite)  # over the run
        return stats


class PPOCriticInterface(ModelInterface):
    """inference (values) and train_step (clipped value loss on the GAE returns)."""

    def __init__(self, ppo: PPOHyperparameters):
        self.cfg = ppo
        self.value_normalizer = None  # made at the first call, with the data-parallel group

    def _normalizer(self, grid):
        if self.cfg.value_norm and self.value_normalizer is None:
            # statistics over the whole batch (all data-parallel ranks), so every rank normalises alike
            self.value_normalizer = F.ValueNormalizer(all_reduce_group=grid.dp_group if grid is not None else None)
        return self.value_normalizer

    def state_dict(self):
        return {"value_normalizer": self.value_normalizer.state_dict()} if self.value_normalizer is not None else {}

    def load_state_dict(self, state, model: Model):
        if "value_normalizer" in state:
            self._normalizer(model.grid).load_state_dict(state["value_normalizer"])

    @torch.no_grad()
    def inference(self, model: Model, data: SequenceSample, mb_spec) -> SequenceSample:
        res = model.engine.forward(data, max_tokens_per_mb=mb_spec.max_tokens_per_mb,
                                   post_fn=lambda out, mb: out.float(), n_mbs=mb_spec.n_mbs)
        if res is None:
            return None
        v = torch.cat(res)
        if self._normalizer(model.grid) is not None:
            v = self.value_normalizer.denormalize(v)
        seqlens = data.seqlens["packed_input_ids"]
        return SequenceSample(keys={"values"}, ids=list(data.ids), seqlens={"values": seqlens},
                              trailing_shapes={"values": ()}, dtypes={"values": torch.float32}, data={"values": v})

    def train_step(self, model: Model, data: SequenceSample, mb_spec) -> Dict[str, float]:
        cfg, grid = self.cfg, model.grid
        mask, _, ret, _ = compute_advantages(data, cfg, grid, use_critic=True, group_size=1, normalize=False)
        # value targets live on answer positions and their predecessor state
        old_v = data.data["values"].float()
        if self._normalizer(grid) is not None:
            self.value_normalizer.update(ret, mask)
            ret_n = self.value_normalizer.normalize(ret)
            old_n = self.value_normalizer.normalize(old_v)
        else:
            ret_n, old_n = ret, old_v
        sample = _per_token(data, {"returns": ret_n.float(), "old_values": old_n.float(), "loss_mask": mask})

        def loss_fn(out, mb):
            m = mb.data["loss_mask"]
            loss, st = F.critic_loss(out.float(), mb.data["old_values"], mb.data["returns"], cfg.value_eps_clip, m)
            stats = StatsTracker()
            stats.mean("critic_loss", st["loss"], weight=m.sum())
            stats.mean("value_clip_ratio", st["value_clip_ratio"], weight=m.sum())
            return loss, stats

        tracker = StatsTracker()
        for part in sample.split(n_minibatches(cfg.ppo_n_minibatches, data.bs, grid, model.module.device)):
            st = model.engine.train_batch(part, loss_fn, lambda mb: float(mb.data["loss_mask"].sum()),
                                          max_tokens_per_mb=mb_spec.max_tokens_per_mb, n_mbs=mb_spec.n_mbs)
            tracker.merge(st.stats)
        means = tracker.export()
        return {"critic_loss": means.get("critic_loss", 0.0), "value_clip_ratio": means.get("value_clip_ratio", 0.0),
                "critic_skipped_nonfinite": float(model.engine.skipped_nonfinite)}


register_interface("ppo_actor", PPOActorInterface)
register_interface("ppo_critic", PPOCriticInterface)
