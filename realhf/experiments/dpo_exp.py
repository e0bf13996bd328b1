"""`dpo`: Direct Preference Optimization (Rafailov et al. 2023) of a policy on preference pairs, against a frozen
reference.

DFG (keys infer the edges)::

  ref_inf     (ref,   inference)  packed_input_ids, prompt_mask -> seq_ref_logprobs   [on the reference's own layout]
  actor_train (actor, train_step) packed_input_ids, prompt_mask, seq_ref_logprobs     [the DPO loss]
  actor_eval  (actor, evaluate)   the validation pairs                                [with dataset.valid_path]
"""
from __future__ import annotations

from typing import Dict

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import ExperimentSpec
from realhf.api.quickstart.preference_config import DPOConfig
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, experiment_spec, model_replicas, replica_specs
from realhf.experiments.rw_exp import preference_data, total_steps

INPUTS = ("packed_input_ids", "prompt_mask")


def build_dpo(cfg: DPOConfig) -> ExperimentSpec:
    seqlen = {"dataset.max_seqlen": cfg.dataset.max_seqlen}
    model_of: Dict[str, str] = {}
    replicas = {}
    for role, mfcs in (("actor", [("actor_train", True)]), ("ref", [("ref_inf", False)])):
        of, replicas[role] = model_replicas(cfg, role, mfcs)
        model_of.update(of)
    for role, path in (("actor", cfg.actor.path), ("ref", cfg.ref_path())):
        for name, (layout, _) in replicas[role].items():
            # the policy's tokenizer serves both: the reference reads the same token ids
            check_model_fits(path, layout, f"{role}.path (replica {name!r})", seqlen=seqlen, tokenizer=role == "actor")
    if cfg.dataset.valid_path:  # the evaluation loads the reference onto the policy's layout for one pass
        check_model_fits(cfg.ref_path(), replicas["actor"]["actor"][0], "ref.path (evaluated on the actor's layout)",
                         seqlen=seqlen)
    n_pairs, train, valid = preference_data(cfg, "actor")
    tok = cfg.actor.path
    models = replica_specs("actor", replicas["actor"], cfg.actor.path, cfg.actor, optimizer=cfg.actor.optimizer,
                           total_train_steps=total_steps(cfg, n_pairs))
    models += replica_specs("ref", replicas["ref"], cfg.ref_path(), cfg.ref, tokenizer_path=tok)
    args = dict(beta=cfg.dpo.beta, ref_path=cfg.ref_path() if valid is not None else "", ref_dtype=cfg.ref.dtype)
    mfcs = [MFCDef("ref_inf", model_of["ref_inf"], "inference", "dpo", args, input_keys=INPUTS,
                   output_keys=("seq_ref_logprobs",), mb_spec=cfg.ref_inf.mb_spec.to_spec()),
            MFCDef("actor_train", model_of["actor_train"], "train_step", "dpo", args,
                   input_keys=INPUTS + ("seq_ref_logprobs",), mb_spec=cfg.actor_train.mb_spec.to_spec())]
    if valid is not None:
        mfcs.append(MFCDef("actor_eval", model_of["actor_train"], "evaluate", "dpo", args))
    n_workers = 1 + max(r for reps in replicas.values() for _, ranks in reps.values() for r in ranks)
    c = cfg.exp_ctrl
    return experiment_spec(cfg, n_workers=n_workers, models=models, mfcs=mfcs, dataset=train, valid_dataset=valid,
                           auto_eval=cfg.auto_eval,
                           eval_freq_epochs=c.eval_freq_epochs if c.eval_freq_epochs is not None else (1 if valid else None))


register_experiment("dpo", DPOConfig, build_dpo)
