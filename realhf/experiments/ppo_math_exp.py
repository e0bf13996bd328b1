"""`ppo-math`: PPO (with a critic) or GRPO (critic-free, group-normalised rewards) on math prompts.

DFG (keys infer the edges):
  actor_gen   (actor,  generate)   packed_prompts -> packed_input_ids, packed_logprobs, prompt_mask, seq_no_eos_mask
  rew_inf     (reward, inference)  packed_input_ids, prompt_mask -> rewards
  ref_inf     (ref,    inference)  packed_input_ids, prompt_mask -> packed_ref_logprobs        [KL on]
  critic_inf  (critic, inference)  packed_input_ids, prompt_mask -> values                     [critic on]
  actor_train (actor,  train_step) all of the above
  critic_train(critic, train_step) all of the above                                           [critic on]
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec
from realhf.api.quickstart.config import PPOMathConfig
from realhf.experiments import register_experiment
from realhf.experiments.common import check_model_fits, model_replicas, replica_specs

GEN_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")


def build_ppo_math(cfg: PPOMathConfig) -> ExperimentSpec:
    from realhf.impl.dataset import MathPromptDataset, validate_jsonl
    from realhf.impl.dataset.jsonl import epoch_steps
    from realhf.impl.dataset.math import MATH_OPTIONAL, MATH_REQUIRED

    mode = cfg.allocation()
    if mode.kind == "decoupled" and mode.gen_backend != "gen":
        raise ValueError(
            f"allocation_mode={cfg.allocation_mode!r}: generation servers of backend {mode.gen_backend!r} are not "
            f"available in this build; use 'gen.{mode.gen}+...' (realhf's own engine on the separate devices)")
    use_ref = cfg.use_ref()
    use_critic = cfg.use_critic
    roles: Dict[str, List[Tuple[str, bool]]] = {"actor": [("actor_gen", False), ("actor_train", True)],
                                                "reward": [("rew_inf", False)]}
    if use_ref:
        roles["ref"] = [("ref_inf", False)]
    if use_critic:
        roles["critic"] = [("critic_inf", False), ("critic_train", True)]
    model_of: Dict[str, str] = {}
    replicas = {}
    for role, mfc_list in roles.items():
        of, replicas[role] = model_replicas(cfg, role, mfc_list)
        model_of.update(of)
    if use_critic and cfg.ppo.value_norm and model_of["critic_inf"] != model_of["critic_train"]:
        raise ValueError("ppo.value_norm=true needs critic_inf and critic_train on one layout and device mesh: the "
                         "running value statistics that training updates are the ones inference denormalises with")
    paths = {"actor": cfg.actor.path, "ref": cfg.ref_path(), "critic": cfg.critic_path()}
    g = cfg.ppo.gen.to_hyperparameters()
    seqlen = {"dataset.max_prompt_len": cfg.dataset.max_prompt_len, "ppo.gen.max_new_tokens": g.max_new_tokens}
    for role in ("actor", "ref", "critic"):
        for name, (dims, _) in replicas.get(role, {}).items():
            # every model reads whole sequences; the actor's tokenizer serves all of them
            check_model_fits(paths[role], dims, f"{role}.path (replica {name!r})", seqlen=seqlen,
                             tokenizer=name == "actor")
    n_samples = validate_jsonl(cfg.dataset.path, MATH_REQUIRED, MATH_OPTIONAL)
    bs = cfg.dataset.train_bs_n_seqs
    # as the workers' EpochIterator: training drops an epoch's last partial batch (see build_sft)
    steps = max(1, epoch_steps(n_samples, bs, drop_last=True)) * cfg.exp_ctrl.total_train_epochs
    if cfg.exp_ctrl.benchmark_steps:
        steps = min(steps, cfg.exp_ctrl.benchmark_steps)
    p = cfg.ppo
    n_workers = 1 + max(r for reps in replicas.values() for _, ranks in reps.values() for r in ranks)
    tok = cfg.actor.path
    train_steps = steps * p.ppo_n_minibatches
    models = replica_specs("actor", replicas["actor"], cfg.actor.path, cfg.actor, optimizer=cfg.actor.optimizer,
                           total_train_steps=train_steps)
    models += replica_specs("ref", replicas.get("ref", {}), cfg.ref_path(), cfg.ref, tokenizer_path=tok)
    models += replica_specs("critic", replicas.get("critic", {}), cfg.critic_path(), cfg.critic,
                            optimizer=cfg.critic.optimizer, total_train_steps=train_steps, is_critic=True,
                            tokenizer_path=tok)
    models += replica_specs("reward", replicas["reward"], "", tokenizer_path=tok)

    gen_cfg = p.gen.interface_args(n=cfg.group_size)
    ppo_args = dict(n_minibatches=p.ppo_n_minibatches, eps_clip=p.eps_clip, c_clip=p.c_clip, kl_ctl=p.kl_ctl,
                    kl_loss_coef=p.kl_loss_coef, discount=p.discount, gae_lambda=p.gae_lambda,
                    max_reward_clip=p.max_reward_clip, adv_norm=p.adv_norm, group_adv_norm=p.group_adv_norm,
                    group_size=cfg.group_size, entropy_coef=p.entropy_coef, mask_too_long=p.mask_too_long,
                    temperature=1.0 if g.greedy else g.temperature, use_critic=use_critic)
    actor_args = dict(generation_config=gen_cfg, seed=g.seed if g.seed is not None else cfg.seed, **ppo_args)
    train_inputs = list(GEN_KEYS) + ["rewards"]
    mfcs = [
        MFCDef("actor_gen", model_of["actor_gen"], "generate", "ppo_actor", actor_args, input_keys=("packed_prompts",),
               output_keys=GEN_KEYS, n_seqs=bs, mb_spec=cfg.actor_gen.mb_spec.to_spec()),
        MFCDef("rew_inf", model_of["rew_inf"], "inference", "rw-math",
               dict(correct_reward=cfg.correct_reward, wrong_reward=cfg.wrong_reward,
                    reward_output_scaling=p.reward_output_scaling, reward_output_bias=p.reward_output_bias,
                    timeout=cfg.reward_timeout_secs, allow_last_number=cfg.reward_allow_last_number),
               input_keys=("packed_input_ids", "prompt_mask"), output_keys=("rewards",), n_seqs=bs,
               mb_spec=cfg.rew_inf.mb_spec.to_spec()),
    ]
    if use_ref:
        mfcs.append(MFCDef("ref_inf", model_of["ref_inf"], "inference", "ppo_actor", dict(ppo_args),
                           input_keys=("packed_input_ids", "prompt_mask"),
                           output_keys=("logprobs",), output_key_remap={"logprobs": "packed_ref_logprobs"}, n_seqs=bs,
                           mb_spec=cfg.ref_inf.mb_spec.to_spec()))
        train_inputs.append("packed_ref_logprobs")
    if use_critic:
        mfcs.append(MFCDef("critic_inf", model_of["critic_inf"], "inference", "ppo_critic", dict(ppo_args, value_norm=p.value_norm),
                           input_keys=("packed_input_ids",), output_keys=("values",), n_seqs=bs,
                           mb_spec=cfg.critic_inf.mb_spec.to_spec()))
        train_inputs.append("values")
        mfcs.append(MFCDef("critic_train", model_of["critic_train"], "train_step", "ppo_critic", dict(ppo_args, value_norm=p.value_norm),
                           input_keys=tuple(train_inputs), n_seqs=bs, mb_spec=cfg.critic_train.mb_spec.to_spec()))
    mfcs.append(MFCDef("actor_train", model_of["actor_train"], "train_step", "ppo_actor", actor_args, input_keys=tuple(train_inputs),
                       n_seqs=bs, mb_spec=cfg.actor_train.mb_spec.to_spec()))
    c = cfg.exp_ctrl
    ds = DatasetSpec(kind="math_prompt", args=dict(path=cfg.dataset.path, max_prompt_len=cfg.dataset.max_prompt_len,
                                                   use_chat_template=cfg.use_chat_template, prompt_template=cfg.prompt_template),
                     batch_size=bs, holder_model="actor")
    del MathPromptDataset
    return ExperimentSpec(
        experiment_name=cfg.experiment_name, trial_name=cfg.trial_name, n_workers=n_workers, models=models, mfcs=mfcs,
        dataset=ds, total_train_epochs=c.total_train_epochs, seed=cfg.seed, log_dir=cfg.log_dir(), save_dir=cfg.ckpt_dir(),
        recover_dir=cfg.recover_dir(), save_freq_epochs=c.save_freq_epochs, save_freq_steps=c.save_freq_steps,
        save_freq_secs=c.save_freq_secs, ckpt_freq_epochs=c.ckpt_freq_epochs, ckpt_freq_steps=c.ckpt_freq_steps,
        ckpt_freq_secs=c.ckpt_freq_secs, benchmark_steps=c.benchmark_steps, threads_per_worker=cfg.cpus_per_worker,
        worker_timeout_secs=cfg.worker_timeout_secs, auto_eval=cfg.auto_eval, param_realloc=cfg.param_realloc,
        wandb=cfg.wandb_init_kwargs(),
    )


register_experiment("ppo-math", PPOMathConfig, build_ppo_math)
