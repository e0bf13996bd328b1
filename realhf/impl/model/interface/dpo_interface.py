"""`dpo`: Direct Preference Optimization (Rafailov et al. 2023) against a frozen reference model.

Each sample is one preference pair (chosen, then rejected; ``realhf.impl.dataset.preference``). A sequence's
log-probability is the sum of its answer tokens' log-probs (the prompt's are not counted), computed with the deferred
output head (the log-softmax runs chunk by chunk on the answer rows only).

* ``inference`` (``ref_inf``, on the reference's own layout): ``seq_ref_logprobs``, one float per sequence.
* ``train_step`` (``actor_train``): the DPO loss :func:`dpo_loss` with the reference's sums.
* ``evaluate``: on the validation pairs, the loss, the log-ratio margin
  ``(log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`` and the pairwise accuracy (margin
  above 0; a tie, as at the start where the policy is the reference, counts half). The reference's sums of the
  validation pairs are computed once, on the policy's workers and layout: the reference is loaded from ``ref_path``
  for that pass and freed after it.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, register_interface
from realhf.base.stats_tracker import StatsTracker
from realhf.impl.model.interface.rw_interface import (check_pairs, pair_accuracy, pair_stats, pair_step_stats,
                                                       reduce_over_replica, split_pairs)
from realhf.impl.model.utils.functional import answer_loss_mask, logprobs_at

REF_KEY = "seq_ref_logprobs"


def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float) -> torch.Tensor:
    """Mean over pairs of ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` with sequence log-probabilities of
    the policy (``pi_*``) and the reference (``ref_*``) (Rafailov et al. 2023, eq. 7)."""
    margin = (pi_chosen.float() - ref_chosen.float()) - (pi_rejected.float() - ref_rejected.float())
    return -F.logsigmoid(beta * margin).mean()


def answer_rows(mb: SequenceSample) -> torch.Tensor:
    """Packed positions whose next token is an answer token: the output head runs on these only."""
    return answer_loss_mask(mb.data["prompt_mask"], mb.cu_seqlens("packed_input_ids")).nonzero().squeeze(-1)


def sequence_logprobs(out, mb: SequenceSample, tp_group=None) -> torch.Tensor:
    """Per sequence of ``mb``, the sum of its answer tokens' log-probs, from the head output on :func:`answer_rows`."""
    rows = answer_rows(mb)
    lp = logprobs_at(out, mb.data["packed_input_ids"], rows, tp_group).float()
    cu = mb.cu_seqlens("packed_input_ids").to(rows.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).to(lp.device)
    return torch.zeros(len(cu) - 1, dtype=lp.dtype, device=lp.device).index_add(0, seq, lp)


def _stats(margin: torch.Tensor, pi_c, pi_r, ref_c, ref_r, beta: float) -> StatsTracker:
    return pair_stats(pair_accuracy(margin, torch.zeros_like(margin)), margin, chosen_reward=beta * (pi_c - ref_c),
                      rejected_reward=beta * (pi_r - ref_r))


class DPOInterface(ModelInterface):
    """See the module docstring. ``beta``: the strength of the implicit KL constraint to the reference;
    ``ref_path``/``ref_dtype``: the reference model that ``evaluate`` loads ("" where the run has no validation set)."""

    def __init__(self, beta: float, ref_path: str = "", ref_dtype: str = "auto"):
        self.beta = beta
        self.ref_path, self.ref_dtype = ref_path, ref_dtype
        self._valid_ref: Optional[List[Optional[torch.Tensor]]] = None  # reference sums of the validation batches

    def _forward_sums(self, engine, batch: SequenceSample, mb_spec=None) -> Optional[torch.Tensor]:
        tp = engine.model.tp_group
        kw = dict(max_tokens_per_mb=mb_spec.max_tokens_per_mb, n_mbs=mb_spec.n_mbs) if mb_spec is not None else {}
        res = engine.forward(batch, post_fn=lambda out, mb: sequence_logprobs(out, mb, tp), head_rows_fn=answer_rows,
                             defer_head=True, **kw)
        return None if res is None else torch.cat(res)

    @torch.no_grad()
    def inference(self, model: Model, data: SequenceSample, mb_spec) -> Optional[SequenceSample]:
        check_pairs(data, "the dpo interface")
        lp = self._forward_sums(model.engine, data, mb_spec)
        if lp is None:  # not the last pipeline stage
            return None
        per_sample = [[1] * len(s) for s in data.seqlens["packed_input_ids"]]
        return SequenceSample(keys={REF_KEY}, ids=list(data.ids), seqlens={REF_KEY: per_sample},
                              trailing_shapes={REF_KEY: ()}, dtypes={REF_KEY: torch.float32}, data={REF_KEY: lp.float()})

    def train_step(self, model: Model, data: SequenceSample, mb_spec) -> Dict[str, float]:
        check_pairs(data, "the dpo interface")
        if REF_KEY not in data.keys:
            raise KeyError(f"the dpo interface needs {REF_KEY!r} (ref_inf's output) among its inputs; it got "
                           f"{sorted(data.keys)}")
        tp, beta = model.module.tp_group, self.beta

        def loss_fn(out, mb):
            pi_c, pi_r = split_pairs(sequence_logprobs(out, mb, tp))
            ref_c, ref_r = split_pairs(mb.data[REF_KEY].float().to(pi_c.device))
            margin = ((pi_c - ref_c) - (pi_r - ref_r)).detach()
            return dpo_loss(pi_c, pi_r, ref_c, ref_r, beta), _stats(margin, pi_c.detach(), pi_r.detach(), ref_c, ref_r, beta)

        st = model.engine.train_batch(data, loss_fn, lambda mb: float(mb.bs), max_tokens_per_mb=mb_spec.max_tokens_per_mb,
                                      n_mbs=mb_spec.n_mbs, head_rows_fn=answer_rows, defer_head=True)
        return pair_step_stats(st, ("chosen_reward", "rejected_reward"))

    def _reference_sums(self, model: Model, batches: List[SequenceSample]) -> List[Optional[torch.Tensor]]:
        """The reference's sums of ``batches``, from ``ref_path`` loaded onto the policy's layout for this pass."""
        from realhf.impl.model.backend.engine import InferenceEngine
        from realhf.impl.model.conversion.hf_io import build_from_hf

        if not self.ref_path:
            raise ValueError("the dpo interface evaluates against the reference model and was given no ref_path")
        env = model.module.env
        dtype = getattr(torch, self.ref_dtype) if self.ref_dtype not in (None, "auto") else env.dtype
        engine = InferenceEngine(build_from_hf(self.ref_path, grid=model.grid, dtype=dtype, env=env))
        try:
            return [self._forward_sums(engine, b) for b in batches]
        finally:
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @torch.no_grad()
    def evaluate(self, model: Model, batches) -> Dict[str, float]:
        batches = list(batches)
        for b in batches:
            check_pairs(b, "the dpo interface")
        if self._valid_ref is None:
            self._valid_ref = self._reference_sums(model, batches)
        tot = torch.zeros(4, dtype=torch.float64, device=model.module.device)
        for b, ref in zip(batches, self._valid_ref):
            pi = self._forward_sums(model.engine, b)
            if pi is None or ref is None:
                continue
            pi_c, pi_r = split_pairs(pi)
            ref_c, ref_r = split_pairs(ref.to(pi.device))
            margin = (pi_c - ref_c) - (pi_r - ref_r)
            n = margin.numel()
            tot += torch.tensor([float(dpo_loss(pi_c, pi_r, ref_c, ref_r, self.beta)) * n,
                                 float(pair_accuracy(margin, torch.zeros_like(margin))), float(margin.sum()), n],
                                dtype=torch.float64, device=tot.device)
        tot = reduce_over_replica(tot, model.grid)
        n = max(float(tot[3]), 1.0)
        return {"eval_loss": float(tot[0]) / n, "eval_accuracy": float(tot[1]) / n, "eval_margin": float(tot[2]) / n,
                "eval_pairs": float(tot[3])}


register_interface("dpo", DPOInterface)
