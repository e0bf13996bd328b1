"""`ppo-math`: PPO (with a critic) or GRPO (critic-free, group-normalised rewards) on math prompts.

DFG (keys infer the edges):
  actor_gen   (actor,  generate)   packed_prompts -> packed_input_ids, packed_logprobs, prompt_mask, seq_no_eos_mask
  rew_inf     (reward, inference)  packed_input_ids, prompt_mask -> rewards   (+ seq_no_eos_mask: reward.unfinished_as_wrong)
              [reward.type=model: a reward model scores packed_input_ids (realhf.experiments.rw_exp)]
  ref_inf     (ref,    inference)  packed_input_ids, prompt_mask -> packed_ref_logprobs        [KL on]
  critic_inf  (critic, inference)  packed_input_ids, prompt_mask -> values                     [critic on]
  actor_inf   (actor,  inference)  packed_input_ids, prompt_mask -> proximal_logprobs          [ppo.mismatch_correction]
  actor_train (actor,  train_step) all of the above
With ppo.dynamic_sampling the master runs actor_gen and rew_inf again over new prompts until the batch holds
dataset.train_bs_n_seqs prompts whose answers' rewards differ (realhf.system.trainer.dynamic_sampling).

With a decoupled allocation (``vllm.d2m1p1+d1m1p1``, ``sglang.``, ``gen.``) actor_gen is served by generation
servers on the generation devices (``realhf.gen_server``): its replica ``actor@1`` is a client on worker 0, the
trained weights reach the servers before each generation (``param_realloc=disk|memory``), and actor_gen also
outputs ``packed_versions`` (the weight version behind every generated token; -1 on prompt tokens).
  critic_train(critic, train_step) all of the above                                           [critic on]

`async-ppo-math` (asynchronous, AReaL's design) builds the same trainer but feeds it a stream of finished
trajectories instead of actor_gen + rew_inf: a rollout manager and rollout workers run episodes (a workflow:
generation on the servers, then the reward) and push them to the trainer's data-parallel heads
(``realhf.system.transport.trajectory_stream``); the trained weights reach the servers through the manager after every
step. Its DFG:
  actor_inf   (actor,  inference)  packed_input_ids, prompt_mask -> proximal_logprobs   [async_rl.prox_logp=recompute]
  ref_inf, critic_inf, critic_train as above
  actor_train (actor,  train_step) the stream's keys (incl. packed_versions, rewards) + the above: decoupled PPO
              (with async_rl.prox_logp=loglinear the proximal log-probs are interpolated there, without actor_inf)
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from realhf.api.core.dfg import MFCDef
from realhf.api.core.system_api import DatasetSpec, DynamicSamplingSpec, ExperimentSpec, RolloutSpec
from realhf.api.quickstart.async_config import AsyncPPOMathConfig
from realhf.api.quickstart.config import PPOMathConfig
from realhf.experiments import register_experiment
from realhf.base.topology import ParallelDims
from realhf.experiments.common import (check_model_fits, experiment_spec, gen_servers_spec, model_replicas,
                                       replica_specs)
from realhf.experiments.rw_exp import check_reward_model, reward_model_mfc

GEN_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")


def build_ppo_math(cfg: PPOMathConfig) -> ExperimentSpec:
    """The spec of a ``ppo-math`` or ``async-ppo-math`` run: the placement of the models, the rollout part of the DFG
    (synchronous: :func:`rollout_mfcs`; asynchronous: the rollout workers of :func:`async_rollout_spec`) and the
    trainer part both share (:func:`trainer_mfcs`)."""
    from realhf.impl.dataset.jsonl import epoch_steps

    is_async = isinstance(cfg, AsyncPPOMathConfig)
    seqlen = _seqlen(cfg, is_async)
    served = None
    if cfg.allocation().kind == "decoupled":  # actor_gen is served by generation servers on the generation devices
        served = gen_servers_spec(cfg, sum(seqlen.values()), cfg.actor.dtype)
    check_algorithm(cfg, is_async)
    model_of, replicas = _placement(cfg, is_async, served is not None)
    _check_models(cfg, replicas, served is not None, seqlen)
    n_samples, steps = _steps(cfg)
    models = _models(cfg, replicas, model_of, served, steps * cfg.ppo.ppo_n_minibatches, is_async)
    # the interfaces take the validated config sections as they are (see realhf/impl/model/interface/ppo_interface.py)
    actor_args = dict(ppo=cfg.ppo, group_size=cfg.group_size, use_critic=cfg.use_critic, seed=cfg.seed)
    if is_async and cfg.async_rl.prox_logp == "loglinear":
        actor_args["prox_logp"] = "loglinear"
    mfcs = [] if is_async else rollout_mfcs(cfg, model_of, actor_args, served is not None)
    mfcs += trainer_mfcs(cfg, model_of, actor_args, is_async)
    bs = cfg.dataset.train_bs_n_seqs
    ds = DatasetSpec(kind="math_prompt", args=dict(path=cfg.dataset.path, max_prompt_len=cfg.dataset.max_prompt_len,
                                                   use_chat_template=cfg.use_chat_template, prompt_template=cfg.prompt_template),
                     batch_size=bs, holder_model="actor")
    rollout = None
    if is_async:  # the prompts go to the rollout workers; the trainer's heads pull finished trajectories
        rollout = async_rollout_spec(cfg, ds, n_samples, steps, dp=replicas["actor"]["actor"][0].dp,
                                     max_seq_len=sum(seqlen.values()))
        ds = DatasetSpec(kind="trajectory_stream", batch_size=bs, holder_model="actor",
                         args=dict(steps_per_epoch=max(1, epoch_steps(n_samples, bs, drop_last=True)),
                                   n_prompts=n_samples))
    # ppo.dynamic_sampling: the master refills a synchronous run's batch (async: the rollout workers, async_rollout_spec)
    dyn = DynamicSamplingSpec(key="rewards") if cfg.ppo.dynamic_sampling and not is_async else None
    n_workers = 1 + max(r for reps in replicas.values() for _, ranks in reps.values() for r in ranks)
    return experiment_spec(cfg, n_workers=n_workers, models=models, mfcs=mfcs, dataset=ds, auto_eval=cfg.auto_eval,
                           param_realloc=cfg.param_realloc, rollout=rollout, dynamic_sampling=dyn)


def rollout_mfcs(cfg: PPOMathConfig, model_of: Dict[str, str], actor_args: dict, served: bool) -> List[MFCDef]:
    """The synchronous rollout: actor_gen generates the answers, rew_inf scores them (the grader, or a reward model
    with ``reward.type=model``)."""
    p = cfg.ppo
    grader_keys = ("packed_input_ids", "prompt_mask") + (("seq_no_eos_mask",) if cfg.reward.unfinished_as_wrong else ())
    gen = MFCDef("actor_gen", model_of["actor_gen"], "generate", "ppo_actor", actor_args, input_keys=("packed_prompts",),
                 output_keys=GEN_KEYS + (("packed_versions",) if served else ()), mb_spec=cfg.actor_gen.mb_spec.to_spec())
    if cfg.reward.uses_model():
        return [gen, reward_model_mfc(cfg, model_of["rew_inf"], grader_keys)]
    return [gen, MFCDef("rew_inf", model_of["rew_inf"], "inference", "rw-math",
                        dict(cfg.reward.grader_args(), reward_output_scaling=p.reward_output_scaling,
                             reward_output_bias=p.reward_output_bias), input_keys=grader_keys, output_keys=("rewards",))]


def trainer_mfcs(cfg: PPOMathConfig, model_of: Dict[str, str], actor_args: dict, is_async: bool) -> List[MFCDef]:
    """The trainer, shared by synchronous and asynchronous runs: over the answers and their rewards, the proximal
    log-probs (actor_inf), the reference's (ref_inf) and the values (critic_inf) where the options need them, then
    critic_train and actor_train."""
    p = cfg.ppo
    train_inputs = list(GEN_KEYS) + ["rewards"] + (["packed_versions"] if is_async else [])
    mfcs = []
    if (cfg.async_rl.prox_logp == "recompute") if is_async else p.mismatch_correction != "none":
        # the proximal log-probs: of decoupled PPO (async), or the trainer's own log-probs of the generated tokens for
        # ppo.mismatch_correction (sync: on actor_train's replica, with its micro-batches). With skip_zero_advantage,
        # actor_inf finds the samples actor_train will train (from the rewards, as train_step does) and recomputes
        # their log-probs only
        inf_keys = ("packed_input_ids", "prompt_mask") + (("packed_logprobs", "seq_no_eos_mask", "rewards")
                                                          if p.skip_zero_advantage else ())
        mb = cfg.actor_inf.mb_spec if is_async else cfg.actor_train.mb_spec
        mfcs.append(MFCDef("actor_inf", model_of.get("actor_inf", model_of["actor_train"]), "inference", "ppo_actor",
                           dict(actor_args, proximal=True), input_keys=inf_keys, output_keys=("logprobs",),
                           output_key_remap={"logprobs": "proximal_logprobs"}, mb_spec=mb.to_spec()))
        train_inputs.append("proximal_logprobs")
    if cfg.use_ref():
        mfcs.append(MFCDef("ref_inf", model_of["ref_inf"], "inference", "ppo_actor", actor_args,
                           input_keys=("packed_input_ids", "prompt_mask"),
                           output_keys=("logprobs",), output_key_remap={"logprobs": "packed_ref_logprobs"},
                           mb_spec=cfg.ref_inf.mb_spec.to_spec()))
        train_inputs.append("packed_ref_logprobs")
    if cfg.use_critic:
        mfcs.append(MFCDef("critic_inf", model_of["critic_inf"], "inference", "ppo_critic", dict(ppo=p),
                           input_keys=("packed_input_ids",), output_keys=("values",),
                           mb_spec=cfg.critic_inf.mb_spec.to_spec()))
        train_inputs.append("values")
        mfcs.append(MFCDef("critic_train", model_of["critic_train"], "train_step", "ppo_critic", dict(ppo=p),
                           input_keys=tuple(train_inputs), mb_spec=cfg.critic_train.mb_spec.to_spec()))
    mfcs.append(MFCDef("actor_train", model_of["actor_train"], "train_step", "ppo_actor", actor_args,
                       input_keys=tuple(train_inputs), mb_spec=cfg.actor_train.mb_spec.to_spec()))
    return mfcs


def _seqlen(cfg: PPOMathConfig, is_async: bool) -> Dict[str, int]:
    """The sequence budget of every model, by the options that make it (for the fit checks' messages)."""
    seqlen = {"dataset.max_prompt_len": cfg.dataset.max_prompt_len, "ppo.gen.max_new_tokens": cfg.ppo.gen.max_new_tokens}
    if is_async:  # the workflow may build longer sequences (several turns, inserted feedback)
        budget = async_workflow(cfg).seq_len_budget(cfg.dataset.max_prompt_len, cfg.ppo.gen.max_new_tokens,
                                                    **cfg.async_rl.workflow_args_dict())
        if budget != sum(seqlen.values()):
            seqlen = {"dataset.max_prompt_len": cfg.dataset.max_prompt_len,
                      f"the rest of the sequence budget of async_rl.workflow={cfg.async_rl.workflow}":
                      budget - cfg.dataset.max_prompt_len}
    return seqlen


def _placement(cfg: PPOMathConfig, is_async: bool, served: bool) -> Tuple[Dict[str, str], Dict[str, dict]]:
    """({MFC: the model replica that runs it}, {role: {replica: (layout, ranks)}}) of the models each role's MFCs
    need."""
    roles: Dict[str, List[Tuple[str, bool]]] = {"actor": [("actor_gen", False), ("actor_train", True)],
                                                "reward": [("rew_inf", False)]}
    if is_async:  # the workflows reward the answers; the trainer may recompute the proximal log-probs
        del roles["reward"]
        if cfg.async_rl.prox_logp == "recompute":
            roles["actor"].append(("actor_inf", False))
    if cfg.use_ref():
        roles["ref"] = [("ref_inf", False)]
    if cfg.use_critic:
        roles["critic"] = [("critic_inf", False), ("critic_train", True)]
    model_of: Dict[str, str] = {}
    replicas = {}
    for role, mfc_list in roles.items():
        of, replicas[role] = model_replicas(cfg, role, mfc_list)
        model_of.update(of)
    if served:  # the served replica is a client on worker 0; the servers hold the generation devices
        replicas["actor"][model_of["actor_gen"]] = (ParallelDims(1, 1, 1), (0,))
    if cfg.use_critic and cfg.ppo.value_norm and model_of["critic_inf"] != model_of["critic_train"]:
        raise ValueError("ppo.value_norm=true needs critic_inf and critic_train on one layout and device mesh: the "
                         "running value statistics that training updates are the ones inference denormalises with")
    return model_of, replicas


def _check_models(cfg: PPOMathConfig, replicas: Dict[str, dict], served: bool, seqlen: Dict[str, int]) -> None:
    """Every model folder fits its layouts and reads whole sequences (the actor's tokenizer serves all of them)."""
    paths = {"actor": cfg.actor.path, "ref": cfg.ref_path(), "critic": cfg.critic_path()}
    if served:
        check_model_fits(cfg.actor.path, cfg.allocation().gen, f"actor.path (generation servers "
                         f"{cfg.allocation_mode!r})", seqlen=seqlen, tokenizer=True)
    for role in ("actor", "ref", "critic"):
        for name, (layout, _) in replicas.get(role, {}).items():
            check_model_fits(paths[role], layout, f"{role}.path (replica {name!r})", seqlen=seqlen,
                             tokenizer=name == "actor")
    if cfg.reward.uses_model():  # a reward model scores in rew_inf: it fits, has a scalar head, the policy's tokenizer
        check_reward_model(cfg, replicas["reward"], seqlen)


def _steps(cfg: PPOMathConfig) -> Tuple[int, int]:
    """(prompts in the dataset, training steps of the run); every row of the dataset is checked here."""
    from realhf.impl.dataset import validate_jsonl
    from realhf.impl.dataset.jsonl import epoch_steps
    from realhf.impl.dataset.math import MATH_OPTIONAL, MATH_REQUIRED

    n_samples = validate_jsonl(cfg.dataset.path, MATH_REQUIRED, MATH_OPTIONAL)
    # as the workers' EpochIterator: training drops an epoch's last partial batch (see build_sft)
    steps = max(1, epoch_steps(n_samples, cfg.dataset.train_bs_n_seqs, drop_last=True)) * cfg.exp_ctrl.total_train_epochs
    if cfg.exp_ctrl.benchmark_steps:
        steps = min(steps, cfg.exp_ctrl.benchmark_steps)
    return n_samples, steps


def _models(cfg: PPOMathConfig, replicas: Dict[str, dict], model_of: Dict[str, str], served, train_steps: int,
            is_async: bool) -> list:
    """The model replicas' specs: actor (its generation replica a client of the servers when served), reference,
    critic, and the reward MFC's holder (the grader: only the tokenizer; a reward model: a critic-style model)."""
    tok = cfg.actor.path
    models = replica_specs("actor", replicas["actor"], cfg.actor.path, cfg.actor, optimizer=cfg.actor.optimizer,
                           total_train_steps=train_steps)
    if served is not None:
        for m in models:
            if m.name == model_of["actor_gen"]:
                m.gen_servers = served
    models += replica_specs("ref", replicas.get("ref", {}), cfg.ref_path(), cfg.ref, tokenizer_path=tok)
    models += replica_specs("critic", replicas.get("critic", {}), cfg.critic_path(), cfg.critic,
                            optimizer=cfg.critic.optimizer, total_train_steps=train_steps, is_critic=True,
                            tokenizer_path=tok)
    if not is_async:
        rm = cfg.reward.model if cfg.reward.uses_model() else None
        models += replica_specs("reward", replicas["reward"], rm.path if rm else "", rm, is_critic=rm is not None,
                                tokenizer_path=tok)
    return models


def check_algorithm(cfg: PPOMathConfig, is_async: bool) -> None:
    """The ``ppo.*`` algorithm options that depend on other sections: ValueError naming the keys."""
    p = cfg.ppo
    if cfg.use_critic and p.adv_estimator != "grpo":
        raise ValueError(f"ppo.adv_estimator={p.adv_estimator} is a critic-free estimator; with use_critic=true the "
                         "advantages are GAE's: set use_critic=false, or leave ppo.adv_estimator=grpo")
    for on, key in ((p.adv_estimator == "rloo", "ppo.adv_estimator=rloo"), (p.dynamic_sampling, "ppo.dynamic_sampling")):
        if on and cfg.group_size < 2:
            raise ValueError(f"{key} compares the answers to one prompt: it needs group_size >= 2, got "
                             f"group_size={cfg.group_size}")
    if is_async and p.mismatch_correction != "none" and cfg.async_rl.prox_logp == "behaviour":
        raise ValueError(f"ppo.mismatch_correction={p.mismatch_correction} weighs the generator's log-probs against "
                         "the trainer's; async_rl.prox_logp=behaviour has no trainer log-probs: use "
                         "async_rl.prox_logp=recompute (or loglinear)")


def async_workflow(cfg: AsyncPPOMathConfig):
    """The workflow class and the reward of ``cfg``, found before any process starts (else a ValueError naming them)."""
    import realhf.impl.workflow  # noqa: F401  (registers the built-in workflows)
    from realhf.api.core.workflow_api import import_object, workflow_class

    a = cfg.async_rl
    try:
        cls = workflow_class(a.workflow)
        reward = import_object(a.reward_fn, "async_rl.reward_fn")
    except (ImportError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"async_rl: {e}") from None
    if not callable(reward):
        raise ValueError(f"async_rl.reward_fn={a.reward_fn!r} is not a class or a function")
    return cls


def async_rollout_spec(cfg: AsyncPPOMathConfig, prompts: DatasetSpec, n_samples: int, steps: int, dp: int,
                       max_seq_len: int) -> RolloutSpec:
    import dataclasses

    a = cfg.async_rl
    return RolloutSpec(
        n_workers=a.n_rollout_workers, batch_size=cfg.dataset.train_bs_n_seqs, dp_size=dp, total_batches=steps,
        n_prompts=n_samples, max_head_offpolicyness=a.max_head_offpolicyness,
        max_concurrent_rollouts=a.max_concurrent_rollouts or cfg.dataset.train_bs_n_seqs, dataset=prompts,
        workflow=a.workflow, workflow_args=a.workflow_args_dict(),
        gconfig={**dataclasses.asdict(cfg.ppo.gen), "n": cfg.group_size, "seed": cfg.seed if cfg.ppo.gen.seed is None
                 else cfg.ppo.gen.seed},
        reward_fn=a.reward_fn, reward_args=cfg.reward.grader_args(), reward_output_scaling=cfg.ppo.reward_output_scaling,
        reward_output_bias=cfg.ppo.reward_output_bias, tokenizer_path=cfg.actor.path,
        dynamic_filtering=a.dynamic_filtering or cfg.ppo.dynamic_sampling, shuffle=True, seed=cfg.seed, episode_timeout_secs=a.episode_timeout_secs,
        max_episode_retries=a.max_episode_retries, weight_update=a.weight_update, max_seq_len=max_seq_len,
        use_chat_template=cfg.use_chat_template)


register_experiment("ppo-math", PPOMathConfig, build_ppo_math)
register_experiment("async-ppo-math", AsyncPPOMathConfig, build_ppo_math)
