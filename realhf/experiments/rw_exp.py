"""`rw`: a reward model trained on preference pairs, and the reward model as ``rew_inf`` of ``ppo-math``.

DFG of ``rw`` (one model, ``default``: a critic-style ReaLModel with a scalar head)::

  trainDefault (default, train_step)  packed_input_ids, prompt_mask   [Bradley–Terry loss on pairs]
  evalDefault  (default, evaluate)    the validation pairs            [with dataset.valid_path]

Its checkpoints are Hugging Face folders with the scalar head as ``score.weight`` and a ``*ForSequenceClassification``
config (``transformers.AutoModelForSequenceClassification`` loads them), which ``ppo-math`` takes as
``reward.model.path`` with ``reward.type=model`` (or ``model+grader``): :func:`reward_model_mfc` makes ``rew_inf`` a
model MFC with its own layout and micro-batches, and :func:`check_reward_model` refuses, before start, a folder
without a scalar head or whose tokenizer differs from the policy's.
"""
from __future__ import annotations

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec
from realhf.api.quickstart.preference_config import RWConfig
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, experiment_spec, replica_specs, single_layout


def preference_data(cfg, holder: str):
    """(number of training pairs, the training DatasetSpec, the validation DatasetSpec or None) of a preference
    experiment; every row of both files is checked here, before any worker starts (a bad row fails with FILE:LINE)."""
    from realhf.impl.dataset.preference import validate_preference_jsonl

    d = cfg.dataset
    n = validate_preference_jsonl(d.train_path)
    args = dict(max_seqlen=d.max_seqlen, use_chat_template=d.use_chat_template)
    valid = None
    if d.valid_path:
        validate_preference_jsonl(d.valid_path)
        valid = DatasetSpec(kind="preference", args=dict(path=d.valid_path, **args), batch_size=d.valid_bs_n_seqs,
                            holder_model=holder, shuffle=False)
    return n, DatasetSpec(kind="preference", args=dict(path=d.train_path, **args), batch_size=d.train_bs_n_seqs,
                          holder_model=holder), valid


def total_steps(cfg, n_pairs: int) -> int:
    """Training steps of the run, as the workers' EpochIterator makes them (an epoch's last partial batch dropped)."""
    from realhf.impl.dataset.jsonl import epoch_steps

    steps = max(1, epoch_steps(n_pairs, cfg.dataset.train_bs_n_seqs, drop_last=True)) * cfg.exp_ctrl.total_train_epochs
    return min(steps, cfg.exp_ctrl.benchmark_steps) if cfg.exp_ctrl.benchmark_steps else steps


def build_rw(cfg: RWConfig) -> ExperimentSpec:
    layout = single_layout(cfg, "trainDefault")
    check_model_fits(cfg.model.path, layout, "model.path", tokenizer=True,
                     seqlen={"dataset.max_seqlen": cfg.dataset.max_seqlen})
    n_pairs, train, valid = preference_data(cfg, "default")
    models = replica_specs("default", {"default": (layout, tuple(range(layout.world_size)))}, cfg.model.path, cfg.model,
                           optimizer=cfg.model.optimizer, total_train_steps=total_steps(cfg, n_pairs), is_critic=True)
    mfcs = [MFCDef(name="trainDefault", model_name="default", interface_type="train_step", interface_impl="rw",
                   input_keys=("packed_input_ids", "prompt_mask"), mb_spec=cfg.mb_spec.to_spec())]
    if valid is not None:
        mfcs.append(MFCDef(name="evalDefault", model_name="default", interface_type="evaluate", interface_impl="rw"))
    c = cfg.exp_ctrl
    return experiment_spec(cfg, n_workers=layout.world_size, models=models, mfcs=mfcs, dataset=train,
                           valid_dataset=valid,
                           eval_freq_epochs=c.eval_freq_epochs if c.eval_freq_epochs is not None else (1 if valid else None))


# ----------------------------------------------------------------------------- the reward model of ppo-math
def has_scalar_head(path: str) -> bool:
    """Whether the HF folder ``path`` holds a scalar head (``score.weight`` in the families' naming)."""
    from realhf.api.core.model_api import get_hf_family
    from realhf.impl.model.conversion.hf_files import _weight_files, config_from_hf_path

    cfg = config_from_hf_path(path, is_critic=True)
    names = get_hf_family(cfg.family).hf_names_for_real(["head.value.weight"], cfg)
    return all(n in _weight_files(path) for n in names)


def check_reward_model(cfg, replicas, seqlen) -> None:
    """Before start, for ``reward.type`` with a model: each replica of ``reward.model.path`` fits its layout and the
    sequences, the folder holds a scalar head (a reward model, not a language model), and its tokenizer is the
    policy's (the reward model reads the policy's token ids as they are)."""
    from realhf.impl.model.conversion.hf_files import tokenizer_difference

    path = cfg.reward.model.path
    for name, (layout, _) in replicas.items():
        check_model_fits(path, layout, f"reward.model.path (replica {name!r})", seqlen=seqlen)
    if not has_scalar_head(path):
        raise ValueError(f"reward.model.path={path!r} has no scalar head (score.weight): it is not a reward model. Train "
                         "one with the rw experiment (its checkpoints are reward models), or use reward.type=grader")
    why = tokenizer_difference(cfg.actor.path, path)
    if why is not None:
        raise ValueError(f"reward.model.path={path!r}: its tokenizer is not the policy's (actor.path={cfg.actor.path!r}): "
                         f"{why}. The reward model scores the policy's token ids as they are; train it from a model "
                         "with the policy's tokenizer")


def reward_model_mfc(cfg, model_name: str, input_keys) -> MFCDef:
    """``rew_inf`` of ppo-math scored by the reward model (``reward.type=model``), plus the grader's grade with
    ``model+grader``: a model MFC with ``rew_inf``'s layout and micro-batches."""
    p = cfg.ppo
    args = dict(reward_output_scaling=p.reward_output_scaling, reward_output_bias=p.reward_output_bias)
    keys = ("packed_input_ids",)
    if cfg.reward.type == "model+grader":
        # the grade before the shared bias and scaling, which the reward interface applies to the sum
        args["grader"] = dict(cfg.reward.grader_args(), reward_output_scaling=1.0, reward_output_bias=0.0)
        keys = tuple(input_keys)
    return MFCDef("rew_inf", model_name, "inference", "rw", args, input_keys=keys, output_keys=("rewards",),
                  mb_spec=cfg.rew_inf.mb_spec.to_spec())


register_experiment("rw", RWConfig, build_rw)
