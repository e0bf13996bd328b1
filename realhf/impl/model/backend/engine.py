"""Inference and training engines over a ReaLModel shard, for any dp x tp x pp layout.

Inputs are ``SequenceSample`` batches holding ``packed_input_ids`` (plus whatever a loss needs). A
batch is cut into micro-batches under ``max_tokens_per_mb``; with pp > 1 the micro-batches flow
through the pipeline (non-blocking forward for inference, 1F1B for training).

Exact loss normalisation: ``loss_fn(output, mb) -> (loss, stats)`` returns the *mean* loss of a
micro-batch, ``loss_weight_fn(mb)`` its weight (e.g. its number of loss tokens). The engine
back-propagates ``loss * weight / total_weight`` where ``total_weight`` is summed over all
micro-batches of all data-parallel ranks, and sums gradients across data-parallel ranks, so the update
is that of the whole batch's mean loss however the batch is split.

Statistics: ``stats`` is a :class:`~realhf.base.stats_tracker.StatsTracker` of the micro-batch (weighted means,
sums, maxima; a plain mapping of floats counts as sums). The engine combines those of every micro-batch and every
data-parallel rank, riding on the all-reduce of the loss, and returns the batch's tracker (``TrainStats.stats``; its
numbers: ``TrainStats.extra``); a caller training several minibatches merges theirs.

Non-finite steps: when the batch's loss or global grad norm is NaN or infinite (values reduced over the
whole replica, so every rank decides alike), the update is not applied (parameters and optimizer state
stay as they were) and counted; once more than ``skip_nonfinite_steps`` steps were skipped over the run,
``train_batch`` raises :class:`NonFiniteError`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base import logging
from realhf.base.stats_tracker import StatsTracker
from realhf.impl.model.backend.optim import OptimizerConfig, build_adamw, lr_multiplier
from realhf.impl.model.nn.generation import GenerationOutput, generate
from realhf.impl.model.nn.real_model import PackedInput, ReaLModel, packed_model_input, tp_shard_dim

logger = logging.getLogger(__name__)

INPUT_KEY = "packed_input_ids"


def _mb_inputs(mb: SequenceSample, device, head_rows_fn=None, defer_head: bool = False,
               share_prefixes: bool = True) -> Tuple[torch.Tensor, PackedInput]:
    ids, inp = packed_model_input(mb.data[INPUT_KEY], mb.flat_seqlens(INPUT_KEY), device, share_prefixes)
    if head_rows_fn is not None:
        inp.head_rows = head_rows_fn(mb).to(device)
    inp.defer_head = defer_head
    return ids, inp


class InferenceEngine:
    """Forward passes (no grad) in micro-batches; results live on the last pipeline stage."""

    def __init__(self, model: ReaLModel):
        self.model = model
        self.grid = model.grid
        self.device = model.device  # from the model's runtime environment
        self.offloaded = False
        # full forward passes compute a prompt shared by adjacent sequences once (``nn.shared_prefix``)
        self.share_prefixes = True

    def offload(self):
        """Move the parameters to host memory (pinned when they live on a GPU) and free the device copy;
        :meth:`load` brings them back. For inference-only replicas (the trainer keeps optimizer views)."""
        if self.offloaded:
            return
        m = self.model
        host = torch.empty(m.flat.shape, dtype=m.flat.dtype, pin_memory=m.flat.is_cuda)  # host memory by definition
        host.copy_(m.flat)
        m.rebind_flat(host)
        self.offloaded = True

    def load(self):
        """Bring offloaded parameters back to the engine's device (a no-op when they are there)."""
        if not self.offloaded:
            return
        m = self.model
        m.rebind_flat(m.flat.to(self.device, copy=True))
        self.offloaded = False

    def _comm(self):
        from realhf.impl.model.parallelism.pipeline import StageComm

        return StageComm(self.grid, self.model.config.hidden_dim, self.model.dtype, self.device)

    @torch.no_grad()
    def forward(
        self,
        sample: SequenceSample,
        max_tokens_per_mb: int = 2**31 - 1,
        post_fn: Optional[Callable[[torch.Tensor, SequenceSample], Any]] = None,
        head_rows_fn: Optional[Callable[[SequenceSample], torch.Tensor]] = None,
        n_mbs: int = 1,
        defer_head: bool = False,
    ) -> Optional[List[Any]]:
        """Per micro-batch ``post_fn(output, mb)`` (or the raw output) on the last stage, in batch order; None
        elsewhere. At least ``n_mbs`` micro-batches (and one per pipeline stage), each within ``max_tokens_per_mb``
        tokens. ``head_rows_fn(mb)``: the packed positions the output head runs on (the output then has one row per
        entry), e.g. only those whose next token is an answer token; default every position. ``defer_head``: a
        language model's last stage hands ``post_fn`` a ``HeadOutput`` instead of logits (log-probs then come chunk
        by chunk: ``utils.functional``)."""
        mbs = sample.split_mbs(max_tokens_per_mb, min_n_mbs=max(n_mbs, self.model.pp)) if sample.bs > 1 else [sample]
        inputs = [_mb_inputs(mb, self.device, head_rows_fn, defer_head, self.share_prefixes) for mb in mbs]
        model = self.model
        if model.pp == 1:
            outs = [model(ids, inp) for ids, inp in inputs]
            return [post_fn(o, mb) if post_fn else o for o, mb in zip(outs, mbs)]
        from realhf.impl.model.parallelism.pipeline import pipeline_forward

        res = pipeline_forward(
            lambda i, x: model(inputs[i][0] if model.is_first else x, inputs[i][1]),
            [ids.numel() for ids, _ in inputs],
            self._comm(),
            model.is_last,
            (lambda i, y: post_fn(y, mbs[i])) if post_fn else None,
        )
        return res if model.is_last else None

    def generate(
        self, prompts: List[List[int]], gconfig: GenerationHyperparameters, eos_token_id=None, generator=None, seeds=None
    ) -> GenerationOutput:
        return generate(self.model, prompts, gconfig, eos_token_id=eos_token_id, generator=generator, seeds=seeds)


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or grad norm more often than ``optimizer.skip_nonfinite_steps`` allows."""


@dataclasses.dataclass
class TrainStats:
    loss: float
    grad_norm: float
    lr: float
    n_mbs: int
    stats: StatsTracker  # the loss function's statistics over the whole batch (every micro-batch and dp rank)
    skipped: bool = False  # this step's update was not applied (non-finite loss or grad norm)
    skipped_nonfinite: int = 0  # steps skipped so far over the run

    @property
    def extra(self) -> Dict[str, float]:
        """The batch's statistics: weighted means, sums and maxima by key."""
        return self.stats.export()


class TrainEngine(InferenceEngine):
    """AdamW training with fp32 master weights (also for bf16 models), gradient accumulation over
    micro-batches, tied-embedding sync across stages, dp all-reduce, global-norm clipping and an LR schedule."""

    def __init__(self, model: ReaLModel, optim: OptimizerConfig, total_train_steps: int):
        super().__init__(model)
        self.optim_cfg = optim
        self.total_train_steps = total_train_steps
        self.step_count = 0  # optimizer updates applied
        self.skipped_nonfinite = 0  # updates skipped for a non-finite loss or grad norm
        model.attach_flat_grad()
        if model.dtype == torch.float32:
            self.master = model.flat
            self.master_grad = model.flat_grad
            named = list(model.named_parameters())
        else:
            self.master = model.flat.detach().float().clone()
            self.master_grad = torch.zeros_like(self.master)
            named = []
            for name, (off, shape) in model.param_spec.items():
                p = torch.nn.Parameter(self.master[off : off + shape.numel()].view(shape))
                p.grad = self.master_grad[off : off + shape.numel()].view(shape)
                named.append((name, p))
        self.optimizer = build_adamw(named, optim)
        # Which parameters count once in the global grad norm: tp-replicated ones only on tp rank 0,
        # and the last stage's copy of a tied embedding not at all (the first stage counts it).
        # Kept as views of the master gradient (boolean indexing of the whole buffer costs seconds).
        grid = self.grid
        counted = []
        for name, (off, shape) in model.param_spec.items():
            if tp_shard_dim(name) is None and grid is not None and grid.tp_rank != 0:
                continue
            if name == "head.lm_head.weight" and model.config.tied_embedding and not model.shares_tied_weight:
                continue
            counted.append((off, shape.numel()))
        self._norm_views = [self.master_grad[o : o + n] for o, n in counted]
        self._set_lr()

    def offload(self):
        raise RuntimeError("a trained replica cannot be offloaded: its optimizer holds views of the parameters")

    def state_dict(self) -> Dict[str, Any]:
        """What a recover checkpoint needs besides the model's parameters: the optimizer state, the step
        and skip counts, and the fp32 master weights when the model's dtype is not float32."""
        st = {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count,
              "skipped_nonfinite": self.skipped_nonfinite}
        if self.master is not self.model.flat:
            st["master"] = self.master
        return st

    def load_state_dict(self, st: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (keys it does not know are ignored; a state without the skip count, from
        before it existed, counts 0 skips)."""
        if "master" in st:
            self.master.copy_(st["master"])
            self.model.flat.copy_(self.master)
        self.optimizer.load_state_dict(st["optimizer"])
        self.step_count = int(st["step_count"])
        self.skipped_nonfinite = int(st.get("skipped_nonfinite", 0))
        self._set_lr()

    def _set_lr(self):
        lr = self.optim_cfg.lr * lr_multiplier(self.step_count, self.total_train_steps, self.optim_cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def train_batch(
        self,
        sample: SequenceSample,
        loss_fn: Callable[[torch.Tensor, SequenceSample], Tuple[torch.Tensor, Any]],
        loss_weight_fn: Callable[[SequenceSample], float],
        max_tokens_per_mb: int = 2**31 - 1,
        n_mbs: int = 1,
        head_rows_fn: Optional[Callable[[SequenceSample], torch.Tensor]] = None,
        defer_head: bool = False,
    ) -> TrainStats:
        model, grid = self.model, self.grid
        model.train()
        mbs = sample.split_mbs(max_tokens_per_mb, min_n_mbs=max(n_mbs, model.pp)) if sample.bs > 1 else [sample]
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        total = torch.tensor(sum(weights), dtype=torch.float64, device=self.device)
        if grid is not None and grid.dp_group is not None:
            dist.all_reduce(total, group=grid.dp_group)
        total = float(total)
        if total <= 0:
            raise ValueError("total loss weight of the batch is 0: nothing to train on")
        model.flat_grad.zero_()
        inputs = [_mb_inputs(mb, self.device, head_rows_fn, defer_head, self.share_prefixes) for mb in mbs]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        stats = StatsTracker()

        def weighted_loss(i, out):
            loss, st = loss_fn(out, mbs[i])
            nonlocal loss_sum
            loss_sum += loss.detach().double() * weights[i] / total
            if isinstance(st, StatsTracker):
                stats.merge(st)
            else:
                for k, v in st.items():
                    stats.sum(k, v)
            return loss * (weights[i] / total)

        if model.pp == 1:
            for i, (ids, inp) in enumerate(inputs):
                weighted_loss(i, model(ids, inp)).backward()
        else:
            from realhf.impl.model.parallelism.pipeline import pipeline_train_1f1b

            pipeline_train_1f1b(
                lambda i, x: model(inputs[i][0] if model.is_first else x, inputs[i][1]),
                weighted_loss,
                [ids.numel() for ids, _ in inputs],
                self._comm(),
                model.pp,
                model.stage,
            )
        # before the update, so that every rank of the replica decides alike whether to apply it
        loss = self._reduce_stats(loss_sum, stats)
        grad_norm, finite = self._reduce_and_clip(math.isfinite(loss))
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
            if self.master is not model.flat:
                model.flat.copy_(self.master)
            self.step_count += 1
            self._set_lr()
        else:
            self._skip_nonfinite(loss, grad_norm)
        return TrainStats(loss=loss, grad_norm=grad_norm, lr=lr, n_mbs=len(mbs), stats=stats, skipped=not finite,
                          skipped_nonfinite=self.skipped_nonfinite)

    def _skip_nonfinite(self, loss: float, grad_norm: float) -> None:
        self.skipped_nonfinite += 1
        budget = self.optim_cfg.skip_nonfinite_steps
        what = f"loss={loss:.6g}, grad_norm={grad_norm:.6g} at optimizer step {self.step_count}"
        if self.skipped_nonfinite > budget:
            raise NonFiniteError(
                f"non-finite training: {what} (of {self.total_train_steps} planned); {self.skipped_nonfinite} "
                f"step(s) with a non-finite loss or grad norm, more than optimizer.skip_nonfinite_steps={budget} "
                "allows. This update was not applied. Lower the learning rate (optimizer.lr) or keep gradient "
                "clipping on (optimizer.gradient_clipping > 0), check the data of this step, or raise "
                "optimizer.skip_nonfinite_steps to skip a few bad batches")
        logger.warning(f"non-finite {what}: update skipped ({self.skipped_nonfinite} of "
                       f"optimizer.skip_nonfinite_steps={budget} skips used)")

    def _reduce_stats(self, loss_sum: torch.Tensor, stats: StatsTracker) -> float:
        """The whole batch's loss on every rank; ``stats`` made the whole batch's in place. Both live on the last
        stage: share them with the replica, then sum over dp (the loss and the stats in one all-reduce)."""
        model, grid = self.model, self.grid
        head = loss_sum.reshape(1)
        if model.pp > 1:
            src = grid.global_rank_of(model.pp - 1, grid.dp_rank, grid.tp_rank)
            head = stats.broadcast_(src, grid.pp_group, head)
        if grid is not None and grid.dp_group is not None:
            head = stats.all_reduce_(grid.dp_group, head)
        return float(head[0])

    def _reduce_and_clip(self, loss_finite: bool) -> Tuple[float, bool]:
        """Reduce the gradients over the replica and clip them by the global norm; (norm, whether the norm
        and the loss are finite on every rank). The loss's flag rides with the squared norm's all-reduce."""
        model, grid = self.model, self.grid
        g = model.flat_grad
        if model.config.tied_embedding and not model.shares_tied_weight and grid is not None and grid.embedding_group is not None:
            name = "embed.wte.weight" if model.is_first else "head.lm_head.weight"
            off, shape = model.param_spec[name]
            dist.all_reduce(g[off : off + shape.numel()], group=grid.embedding_group)
        if grid is not None and grid.dp_group is not None:
            dist.all_reduce(g, group=grid.dp_group)
        if self.master is not model.flat:
            self.master_grad.copy_(g)
        mg = self.master_grad
        norms = torch._foreach_norm(self._norm_views) if self._norm_views else []
        dev = self.device
        sq = (torch.stack([n.double() for n in norms]).pow(2).sum() if norms
              else torch.zeros((), dtype=torch.float64, device=dev))
        red = torch.stack([sq, torch.tensor(0.0 if loss_finite else 1.0, dtype=torch.float64, device=dev)])
        if grid is not None:
            if grid.tp_group is not None:
                dist.all_reduce(red, group=grid.tp_group)
            if grid.pp_group is not None:
                dist.all_reduce(red, group=grid.pp_group)
        norm = float(red[0].sqrt())
        finite = math.isfinite(norm) and float(red[1]) == 0
        clip = self.optim_cfg.gradient_clipping
        if finite and clip > 0 and norm > clip:
            mg.mul_(clip / (norm + 1e-6))
        return norm, finite
