"""`sft`: supervised fine-tuning on {prompt, answer} JSONL (loss on answer tokens), eval loss per epoch."""
from __future__ import annotations

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec
from realhf.api.quickstart.config import SFTConfig
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, experiment_spec, replica_specs, single_layout


def build_sft(cfg: SFTConfig) -> ExperimentSpec:
    from realhf.impl.dataset import PromptAnswerDataset, validate_jsonl
    from realhf.impl.dataset.jsonl import epoch_steps

    layout = single_layout(cfg, "trainDefault")
    check_model_fits(cfg.model.path, layout, "model.path", tokenizer=True,
                     seqlen={"dataset.max_seqlen": cfg.dataset.max_seqlen})
    # every row is checked here, before any worker starts: a bad line fails with file:line
    n_samples = validate_jsonl(cfg.dataset.train_path, PromptAnswerDataset.REQUIRED, PromptAnswerDataset.OPTIONAL)
    if cfg.dataset.valid_path:
        validate_jsonl(cfg.dataset.valid_path, PromptAnswerDataset.REQUIRED, PromptAnswerDataset.OPTIONAL)
    ds_args = dict(path=cfg.dataset.train_path, max_seqlen=cfg.dataset.max_seqlen)
    # as the workers' EpochIterator: training drops an epoch's last partial batch (the order is reshuffled every
    # epoch, so other samples are left out each time); a file too small for one batch fails when the workers load it
    steps_per_epoch = max(1, epoch_steps(n_samples, cfg.dataset.train_bs_n_seqs, drop_last=True))
    total = steps_per_epoch * cfg.exp_ctrl.total_train_epochs
    if cfg.exp_ctrl.benchmark_steps:
        total = min(total, cfg.exp_ctrl.benchmark_steps)
    models = replica_specs("default", {"default": (layout, tuple(range(layout.world_size)))}, cfg.model.path, cfg.model,
                           optimizer=cfg.model.optimizer, total_train_steps=total)
    mfcs = [MFCDef(name="trainDefault", model_name="default", interface_type="train_step", interface_impl="sft",
                   input_keys=("packed_input_ids", "prompt_mask"), mb_spec=cfg.mb_spec.to_spec())]
    valid = None
    if cfg.dataset.valid_path:
        mfcs.append(MFCDef(name="evalDefault", model_name="default", interface_type="evaluate", interface_impl="sft"))
        valid = DatasetSpec(kind="prompt_answer", args=dict(path=cfg.dataset.valid_path, max_seqlen=cfg.dataset.max_seqlen),
                            batch_size=cfg.dataset.valid_bs_n_seqs, holder_model="default", shuffle=False)
    c = cfg.exp_ctrl
    return experiment_spec(
        cfg, n_workers=layout.world_size, models=models, mfcs=mfcs,
        dataset=DatasetSpec(kind="prompt_answer", args=ds_args, batch_size=cfg.dataset.train_bs_n_seqs, holder_model="default"),
        valid_dataset=valid, auto_eval=cfg.auto_eval,
        eval_freq_epochs=c.eval_freq_epochs if c.eval_freq_epochs is not None else (1 if valid else None),
    )


register_experiment("sft", SFTConfig, build_sft)
