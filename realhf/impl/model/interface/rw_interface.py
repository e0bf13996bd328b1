"""`rw`: a reward model — the transformer with a scalar head ([hidden -> 1], a critic-style ReaLModel, saved as
``score.weight`` as transformers' ``*ForSequenceClassification`` stores it) that scores a whole sequence at its last
token.

* ``train_step`` (the ``rw`` experiment): pairwise preferences, each sample one pair (chosen, then rejected; see
  ``realhf.impl.dataset.preference``), under the Bradley–Terry loss ``-log sigmoid(r_chosen - r_rejected)``
  (:func:`bradley_terry_loss`).
* ``evaluate``: the same loss and the pairwise accuracy (chosen scored above rejected; a tie counts half) on the
  validation pairs.
* ``inference`` (``rew_inf`` of ``ppo-math`` with ``reward.type=model``): ``rewards``, one float per answer:
  ``(score + reward_output_bias) * reward_output_scaling``; with ``grader`` (``reward.type=model+grader``) the
  rule-based grade of the answer (``rw-math``'s, unscaled) is added to the score first.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, register_interface
from realhf.base.stats_tracker import StatsTracker


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of ``-log sigmoid(r_chosen - r_rejected)``: the negative log-likelihood of the preferences
    under the Bradley–Terry model ``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)`` (Ouyang et al. 2022,
    eq. 1, one pair per prompt)."""
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """How many pairs rank chosen above rejected (a tie counts half), as a float tensor."""
    return (chosen > rejected).float().sum() + 0.5 * (chosen == rejected).float().sum()


def check_pairs(sample: SequenceSample, who: str) -> None:
    """ValueError unless every sample of ``sample`` holds one pair: two sequences, chosen then rejected."""
    bad = [i for i, s in enumerate(sample.seqlens["packed_input_ids"]) if len(s) != 2]
    if bad:
        raise ValueError(f"{who} trains on preference pairs (two sequences per sample: chosen, rejected); sample "
                         f"{sample.ids[bad[0]]!r} holds {len(sample.seqlens['packed_input_ids'][bad[0]])} sequences. "
                         "Use the 'preference' dataset")


def split_pairs(per_seq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of a per-sequence tensor of pairs in batch order."""
    return per_seq[0::2], per_seq[1::2]


def last_token_rows(mb: SequenceSample) -> torch.Tensor:
    """The packed position of each sequence's last token: where the scalar head scores it."""
    return (mb.cu_seqlens("packed_input_ids")[1:] - 1).long()


def reduce_over_replica(tot: torch.Tensor, grid) -> torch.Tensor:
    """Sums computed on the last pipeline stage of each data-parallel rank, made the replica's totals on every rank."""
    if grid is None:
        return tot
    if grid.pp_size > 1:
        src = grid.global_rank_of(grid.pp_size - 1, grid.dp_rank, grid.tp_rank)
        dist.broadcast(tot, src=src, group=grid.pp_group)
    if grid.dp_group is not None:
        dist.all_reduce(tot, group=grid.dp_group)
    return tot


def pair_step_stats(st, per_pair: Tuple[str, ...]) -> Dict[str, float]:
    """The stats of a training step over preference pairs (``st``: the engine's train_batch result, its stats those
    of :func:`pair_stats`): the loss, the accuracy, the margin and ``per_pair`` (means per pair), and the step's own."""
    ex = st.extra
    out = {"loss": st.loss, **{k: ex.get(k, 0.0) for k in ("accuracy", "margin", *per_pair)}}
    out.update(grad_norm=st.grad_norm, lr=st.lr, n_mbs=st.n_mbs, n_pairs=ex.get("n_pairs", 0.0),
               skipped_nonfinite=float(st.skipped_nonfinite))
    return out


def pair_stats(n_correct: torch.Tensor, margin: torch.Tensor, **per_pair: torch.Tensor) -> StatsTracker:
    """The stats of a micro-batch of pairs: means per pair of the accuracy (``n_correct``: :func:`pair_accuracy`),
    the ``margin`` and each of ``per_pair`` (per-pair tensors), and the number of pairs."""
    n = margin.numel()
    stats = StatsTracker()
    stats.sum("n_pairs", n)
    stats.mean("accuracy", float(n_correct) / max(n, 1), weight=n)
    for k, v in (("margin", margin), *per_pair.items()):
        stats.mean(k, v.float().mean(), weight=n)  # no pairs: weighs nothing
    return stats


class RewardModelInterface(ModelInterface):
    """See the module docstring. ``reward_output_scaling`` / ``reward_output_bias`` (``ppo.*`` of ppo-math) shape
    the rewards of ``inference``; ``grader``: the keyword arguments of the ``rw-math`` interface whose grade is added
    to the score (None: the score alone)."""

    def __init__(self, reward_output_scaling: float = 1.0, reward_output_bias: float = 0.0,
                 grader: Optional[dict] = None):
        self.reward_output_scaling, self.reward_output_bias = reward_output_scaling, reward_output_bias
        self.grader = None
        if grader is not None:
            from realhf.impl.model.interface.math_reward_interface import MathRewardInterface

            self.grader = MathRewardInterface(**grader)

    def warmup(self, model: Model) -> None:
        if self.grader is not None:
            self.grader.warmup(model)

    def train_step(self, model: Model, data: SequenceSample, mb_spec) -> Dict[str, float]:
        check_pairs(data, "the rw interface")

        def loss_fn(values, mb):
            chosen, rejected = split_pairs(values.float())
            c, r = chosen.detach(), rejected.detach()
            return bradley_terry_loss(chosen, rejected), pair_stats(pair_accuracy(c, r), c - r, chosen_score=c,
                                                                    rejected_score=r)

        st = model.engine.train_batch(data, loss_fn, lambda mb: float(mb.bs), max_tokens_per_mb=mb_spec.max_tokens_per_mb,
                                      n_mbs=mb_spec.n_mbs, head_rows_fn=last_token_rows)
        return pair_step_stats(st, ("chosen_score", "rejected_score"))

    @torch.no_grad()
    def evaluate(self, model: Model, batches) -> Dict[str, float]:
        """Loss, pairwise accuracy and mean score margin over the validation pairs (all data-parallel ranks)."""
        tot = torch.zeros(4, dtype=torch.float64, device=model.module.device)
        for b in batches:
            check_pairs(b, "the rw interface")
            res = model.engine.forward(b, post_fn=lambda v, mb: v.float(), head_rows_fn=last_token_rows)
            if res is None:
                continue
            chosen, rejected = split_pairs(torch.cat(res))
            n = chosen.numel()
            tot += torch.tensor([float(bradley_terry_loss(chosen, rejected)) * n, float(pair_accuracy(chosen, rejected)),
                                 float((chosen - rejected).sum()), n], dtype=torch.float64, device=tot.device)
        tot = reduce_over_replica(tot, model.grid)
        n = max(float(tot[3]), 1.0)
        return {"eval_loss": float(tot[0]) / n, "eval_accuracy": float(tot[1]) / n, "eval_margin": float(tot[2]) / n,
                "eval_pairs": float(tot[3])}

    @torch.no_grad()
    def inference(self, model: Model, data: SequenceSample, mb_spec) -> Optional[SequenceSample]:
        res = model.engine.forward(data, max_tokens_per_mb=mb_spec.max_tokens_per_mb, post_fn=lambda v, mb: v.float(),
                                   head_rows_fn=last_token_rows, n_mbs=mb_spec.n_mbs)
        if res is None:  # not the last pipeline stage
            return None
        rewards = torch.cat(res).float()
        if self.grader is not None:
            graded = self.grader.inference(model, data, mb_spec).data["rewards"]
            rewards = rewards + graded.to(rewards.device).float()
        rewards = (rewards + self.reward_output_bias) * self.reward_output_scaling
        per_sample: List[List[int]] = [[1] * len(s) for s in data.seqlens["packed_input_ids"]]
        return SequenceSample(keys={"rewards"}, ids=list(data.ids), seqlens={"rewards": per_sample},
                              trailing_shapes={"rewards": ()}, dtypes={"rewards": torch.float32},
                              data={"rewards": rewards})


register_interface("rw", RewardModelInterface)
