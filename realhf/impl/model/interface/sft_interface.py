"""Supervised fine-tuning: next-token loss on answer tokens only (prompt tokens masked out)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, register_interface
from realhf.base.stats_tracker import StatsTracker
from realhf.impl.model.utils.functional import answer_loss_mask, packed_logprobs


def answer_token_mask(sample: SequenceSample) -> torch.Tensor:
    return answer_loss_mask(sample.data["prompt_mask"], sample.cu_seqlens("packed_input_ids"))


def _answer_nll(out, mb: SequenceSample, tp_group):
    """(mean negative log-likelihood of ``mb``'s answer tokens, their number)."""
    ids = mb.data["packed_input_ids"]
    lp, _ = packed_logprobs(out, ids, mb.cu_seqlens("packed_input_ids"), tp_group)
    mask = answer_token_mask(mb)
    n = mask.sum()
    return -(lp * mask).sum() / n.clamp(min=1), float(n)


def _loss(out, mb: SequenceSample, tp_group):
    loss, n = _answer_nll(out, mb, tp_group)
    stats = StatsTracker()
    stats.sum("n_answer_tokens", n)
    return loss, stats


class SFTInterface(ModelInterface):
    def train_step(self, model: Model, data: SequenceSample, mb_spec) -> Dict[str, float]:
        eng = model.engine
        tp = model.module.tp_group
        st = eng.train_batch(
            data, lambda out, mb: _loss(out, mb, tp), lambda mb: float(answer_token_mask(mb).sum()),
            max_tokens_per_mb=mb_spec.max_tokens_per_mb, n_mbs=mb_spec.n_mbs, defer_head=True,
        )
        return {"loss": st.loss, "grad_norm": st.grad_norm, "lr": st.lr, "n_mbs": st.n_mbs,
                "n_answer_tokens": st.extra.get("n_answer_tokens", 0.0),
                "skipped_nonfinite": float(st.skipped_nonfinite)}

    @torch.no_grad()
    def evaluate(self, model: Model, batches) -> Dict[str, float]:
        """Token-averaged loss over this dp rank's share of the validation set, reduced over dp."""
        tp = model.module.tp_group
        tot = torch.zeros(2, dtype=torch.float64, device=model.module.device)
        for b in batches:
            res = model.engine.forward(b, post_fn=lambda out, mb: _answer_nll(out, mb, tp), defer_head=True)
            if res is not None:
                for loss, n in res:
                    tot[0] += float(loss) * n
                    tot[1] += n
        grid = model.grid
        if grid.pp_size > 1:
            src = grid.global_rank_of(grid.pp_size - 1, grid.dp_rank, grid.tp_rank)
            dist.broadcast(tot, src=src, group=grid.pp_group)
        if grid.dp_group is not None:
            dist.all_reduce(tot, group=grid.dp_group)
        return {"eval_loss": float(tot[0] / max(tot[1], 1.0)), "eval_tokens": float(tot[1])}


register_interface("sft", SFTInterface)
