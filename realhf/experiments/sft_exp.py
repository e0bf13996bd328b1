"""`sft`: supervised fine-tuning on {prompt, answer} JSONL (loss on answer tokens), eval loss per epoch."""
from __future__ import annotations

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec, ModelSpec
from realhf.api.quickstart.config import SFTConfig
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, single_layout


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
    n = layout.world_size
    ds_args = dict(path=cfg.dataset.train_path, max_seqlen=cfg.dataset.max_seqlen)
    # as the workers' EpochIterator: training drops an epoch's last partial batch (the order is reshuffled every
    # epoch, so other samples are left out each time); a file too small for one batch fails when the workers load it
    steps_per_epoch = max(1, epoch_steps(n_samples, cfg.dataset.train_bs_n_seqs, drop_last=True))
    total = steps_per_epoch * cfg.exp_ctrl.total_train_epochs
    if cfg.exp_ctrl.benchmark_steps:
        total = min(total, cfg.exp_ctrl.benchmark_steps)
    model = ModelSpec(name="default", path=cfg.model.path, layout=layout, ranks=list(range(n)), dtype=cfg.model.dtype,
                      optimizer=cfg.model.optimizer, total_train_steps=total, compile=cfg.model.compile)
    mfcs = [MFCDef(name="trainDefault", model_name="default", interface_type="train_step", interface_impl="sft",
                   input_keys=("packed_input_ids", "prompt_mask"), n_seqs=cfg.dataset.train_bs_n_seqs,
                   mb_spec=cfg.mb_spec.to_spec())]
    valid = None
    if cfg.dataset.valid_path:
        mfcs.append(MFCDef(name="evalDefault", model_name="default", interface_type="evaluate", interface_impl="sft",
                           n_seqs=cfg.dataset.valid_bs_n_seqs))
        valid = DatasetSpec(kind="prompt_answer", args=dict(path=cfg.dataset.valid_path, max_seqlen=cfg.dataset.max_seqlen),
                            batch_size=cfg.dataset.valid_bs_n_seqs, holder_model="default", shuffle=False)
    c = cfg.exp_ctrl
    return ExperimentSpec(
        experiment_name=cfg.experiment_name, trial_name=cfg.trial_name, n_workers=n, models=[model], mfcs=mfcs,
        dataset=DatasetSpec(kind="prompt_answer", args=ds_args, batch_size=cfg.dataset.train_bs_n_seqs, holder_model="default"),
        valid_dataset=valid, total_train_epochs=c.total_train_epochs, seed=cfg.seed, log_dir=cfg.log_dir(),
        save_dir=cfg.ckpt_dir(), recover_dir=cfg.recover_dir(),
        save_freq_epochs=c.save_freq_epochs, save_freq_steps=c.save_freq_steps, save_freq_secs=c.save_freq_secs,
        ckpt_freq_epochs=c.ckpt_freq_epochs, ckpt_freq_steps=c.ckpt_freq_steps, ckpt_freq_secs=c.ckpt_freq_secs,
        eval_freq_epochs=c.eval_freq_epochs if c.eval_freq_epochs is not None else (1 if valid else None),
        eval_freq_steps=c.eval_freq_steps, benchmark_steps=c.benchmark_steps,
        threads_per_worker=cfg.cpus_per_worker, worker_timeout_secs=cfg.worker_timeout_secs, auto_eval=cfg.auto_eval,
        wandb=cfg.wandb_init_kwargs(),
    )


register_experiment("sft", SFTConfig, build_sft)
