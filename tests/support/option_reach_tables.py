"""The option tables of ``tests/unit/test_option_reach.py``: for each experiment, each option of its config with a
non-default value and where that value must arrive (:class:`Reach`), or that the launcher reads it
(:class:`Launcher`), or that the experiment refuses it (:class:`Refused`); and the options each experiment needs to
build at all (``BASE_ARGS``, ``NEEDS``)."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Dict, Tuple, Union

SAME = object()  # expect the option's parsed value


@dataclasses.dataclass
class Reach:
    """``value`` (CLI text, or a function of the test's files) must arrive at ``where(built)``: as the option's
    parsed value, or as ``expect(parsed value)`` when given."""

    value: Union[str, Callable[[Any], str]]
    where: Callable[["Built"], Any]
    expect: Any = SAME
    needs: Tuple[str, ...] = ()  # overrides that make the option matter, in both builds
    with_: Tuple[str, ...] = ()  # overrides that go with the value only


@dataclasses.dataclass
class Launcher:
    """Read by the launcher (realhf/apps, realhf/scheduler) from the config itself, before any process or spec
    exists: the option must parse to its value and ``reader`` must read ``config.<key>``."""

    value: str
    reader: str


@dataclasses.dataclass
class Refused:
    """A non-default ``value`` has no use in this experiment: the config refuses it, naming the key."""

    value: str


class Built:
    """What the processes build from one config: the spec and the model workers' interface objects."""

    def __init__(self, spec):
        from realhf.system.trainer.model_worker import make_interfaces

        self.spec = spec
        self.ifaces = make_interfaces(spec.mfcs)

    def mfc(self, name: str):
        return next(m for m in self.spec.mfcs if m.name == name)

    def iface(self, mfc: str):
        return self.ifaces[mfc]

    def model(self, name: str):
        return self.spec.model(name)

    def model_of(self, mfc: str):
        """The model replica an MFC runs on."""
        return self.spec.model(str(self.mfc(mfc).model_name))


def _spec(name):
    return lambda b: getattr(b.spec, name)


def _ds(arg):
    return lambda b: b.spec.dataset.args[arg]


def _gconfig(mfc, field):
    return lambda b: getattr(b.iface(mfc).gconfig, field)


def _attrs(*paths):
    """The values at ``"<mfc>.<attr>[.<attr>]"`` of the interfaces (a tuple when several)."""

    def get(b):
        vals = [functools.reduce(getattr, p.split(".")[1:], b.iface(p.split(".")[0])) for p in paths]
        return vals[0] if len(vals) == 1 else tuple(vals)

    return get


def _n(v, k):
    return (v,) * k


# ------------------------------------------------------------------------------------------ options of every experiment
COMMON: Dict[str, Any] = {
    "experiment_name": Reach("reach-exp", _spec("experiment_name")),
    "trial_name": Reach("reach-trial", _spec("trial_name")),
    # the run folder (logs, checkpoints, recover) the master and workers use
    "fileroot": Reach(lambda env: env.root2, lambda b: os.path.dirname(os.path.dirname(os.path.dirname(b.spec.log_dir)))),
    "seed": Reach("7", _spec("seed")),
    "n_nodes": Reach("2", _spec("n_workers"), needs=("allocation_mode=heuristic",)),
    "n_devices_per_node": Reach("2", _spec("n_workers"), needs=("allocation_mode=heuristic",)),
    "cpus_per_worker": Reach("2", _spec("cpus_per_worker")),
    "cpus_per_worker_max": Reach("2", _spec("cpus_per_worker_max")),  # model workers install cpu_share
    "allocation_mode": Reach("d2m1p1", lambda b: b.model_of(b.spec.mfcs[0].name).layout.dp, expect=2,
                             needs=("n_devices_per_node=2", "allocation_mode=d1m1p2")),
    "worker_timeout_secs": Reach("30.0", _spec("worker_timeout_secs")),
    # wandb.init arguments of the master's stats logger
    "wandb.mode": Reach("offline", lambda b: (b.spec.wandb or {}).get("mode")),
    **{f"wandb.{k}": Reach(f"reach-{k}", lambda b, k=k: b.spec.wandb.get(k), needs=("wandb.mode=offline",))
       for k in ("entity", "project", "name", "group", "job_type", "notes")},
    "wandb.tags": Reach("[a,b]", lambda b: b.spec.wandb.get("tags"), needs=("wandb.mode=offline",)),
    "tensorboard.path": Reach(lambda env: os.path.join(env.root2, "tb"), _spec("tensorboard_dir")),
    "exp_ctrl.benchmark_steps": Reach("3", _spec("benchmark_steps")),
    # Read by the launcher only (checked against the code that reads them, as no spec field carries them):
    "mode": Launcher("ray", "realhf/apps/main.py"),  # which scheduler starts the processes
    "recover_mode": Launcher("auto", "realhf/apps/main.py"),  # resume or start afresh, relaunch after a failure
    "recover_retries": Launcher("3", "realhf/apps/main.py"),
    "ray_address": Launcher("auto", "realhf/scheduler/ray_launcher.py"),  # the Ray cluster joined
    "ray_gpus_per_worker": Launcher("1.0", "realhf/scheduler/ray_launcher.py"),  # Ray resources of each worker
    "gpus_per_node": Launcher("1", "realhf/apps/remote.py"),  # which GPU a model worker of a shared node takes
    # the memory plan's capacity: checked before start, sizes max_tokens_per_mb=auto (tests/e2e/test_memory_plan.py)
    "device_memory_gib": Launcher("80.0", "realhf/experiments/memory_plan.py"),
    # mode=slurm: the sbatch/srun flags and task wrappers (tests/e2e/test_slurm_dry_run.py checks the printed commands)
    **{f"slurm.{k}": Launcher(v, "realhf/scheduler/slurm.py") for k, v in (
        ("partition", "gpu"), ("account", "rl"), ("time", "1:00:00"), ("gpus_per_slot", "0"), ("mem_per_slot", "1G"),
        ("container_image", "img.sqsh"), ("container_mounts", "/a:/a"), ("sbatch_args", "--qos=high"),
        ("srun_args", "--mpi=none"), ("host_cmd", "hostname"), ("launcher_lease_secs", "30"))},
}

# ------------------------------------------------------------------------------------------ training experiments
TRAINING: Dict[str, Any] = {
    "exp_ctrl.total_train_epochs": Reach("2", _spec("total_train_epochs")),
    **{f"exp_ctrl.{k}": Reach("3", _spec(k)) for k in ("save_freq_epochs", "save_freq_steps", "save_freq_secs",
                                                       "ckpt_freq_epochs", "ckpt_freq_steps", "ckpt_freq_secs")},
    # the checkpoint evaluator (realhf/system/trainer/evaluator.py) takes the section as it is: what it reads
    "auto_eval.enabled": Reach("true", lambda b: b.spec.auto_eval.enabled),
    "auto_eval.data_names": Reach("[gsm8k,math_500]", lambda b: b.spec.auto_eval.data_names),
    "auto_eval.data_dir": Reach(lambda env: env.root2, lambda b: b.spec.auto_eval.eval_kwargs()["data_dir"]),
    **{f"auto_eval.{k}": Reach(v, lambda b, k=k: b.spec.auto_eval.eval_kwargs()[k])
       for k, v in (("max_problems", "5"), ("n_sampling", "2"), ("max_gen_tokens", "64"), ("prompt_type", "plain"),
                    ("allow_last_number", "true"), ("temperature", "0.8"), ("top_p", "0.9"), ("seed", "3"),
                    ("batch_size", "4"), ("device", "cuda"))},
    "auto_eval.threads": Reach("2", lambda b: b.spec.auto_eval.eval_kwargs()["threads_per_worker"]),
    "auto_eval.timeout": Reach("60.0", lambda b: b.spec.auto_eval.timeout),
    "auto_eval.final_wait_secs": Reach("60.0", lambda b: b.spec.auto_eval.final_wait_secs),
    "auto_eval.output_dir": Reach(lambda env: env.root2, lambda b: b.spec.auto_eval.output_dir),
}

OPTIMIZER = (("lr", "2e-4"), ("weight_decay", "0.1"), ("beta1", "0.8"), ("beta2", "0.99"), ("eps", "1e-6"),
             ("lr_scheduler_type", "cosine"), ("warmup_steps_proportion", "0.1"), ("min_lr_ratio", "0.1"),
             ("gradient_clipping", "0.5"), ("skip_nonfinite_steps", "2"))


def _model_options(prefix: str, model: str, trains: bool, offload=None) -> Dict[str, Any]:
    """``<prefix>.*`` of a ModelConfig / ModelTrainEvalConfig: fields of the ModelSpec of ``model`` (the engine's
    optimizer config is the ModelSpec's, as it is)."""
    out = {f"{prefix}.path": Reach(lambda env: env.model2, lambda b: b.model(model).path),
           f"{prefix}.dtype": Reach("bfloat16", lambda b: b.model(model).dtype),
           f"{prefix}.compile": Reach("true", lambda b: b.model(model).compile)}
    if offload is not None:
        out[f"{prefix}.offload"] = offload
    if trains:
        out.update({f"{prefix}.optimizer.{k}": Reach(v, lambda b, k=k: getattr(b.model(model).optimizer, k))
                    for k, v in OPTIMIZER})
        # the model worker sets ReaLModel.checkpointing from it (the memory plan reads the config too)
        out[f"{prefix}.gradient_checkpointing"] = Reach("true", lambda b: b.model(model).gradient_checkpointing)
    return out


def _mb_spec(prefix: str, mfc: str) -> Dict[str, Any]:
    return {f"{prefix}.n_mbs": Reach("2", lambda b: b.mfc(mfc).mb_spec.n_mbs),
            f"{prefix}.max_tokens_per_mb": Reach("4096", lambda b: b.mfc(mfc).mb_spec.max_tokens_per_mb)}


def _sampling(prefix: str, mfc: str) -> Dict[str, Any]:
    """``<prefix>.*`` of a SamplingConfig: the generating interface's engine options."""
    out = {f"{prefix}.{k}": Reach(v, _gconfig(mfc, k))
           for k, v in (("max_new_tokens", "64"), ("min_new_tokens", "2"), ("greedy", "true"), ("top_p", "0.9"),
                        ("top_k", "5"), ("compile_decode", "true"), ("cuda_graph", "false"),
                        ("kv_cache_dtype", "float16"))}
    out[f"{prefix}.stop_token_ids"] = Reach("[5,6]", lambda b: list(b.iface(mfc).gconfig.stop_token_ids))
    out[f"{prefix}.seed"] = Reach("11", _attrs(f"{mfc}.seed"))  # the per-sample random streams
    return out


# ------------------------------------------------------------------------------------------ sft
SFT: Dict[str, Any] = {
    **TRAINING,
    # only inference-only replicas are offloaded; sft's one model trains at every step
    **_model_options("model", "default", trains=True, offload=Refused("true")),
    "dataset.train_path": Reach(lambda env: env.sft2, _ds("path")),
    "dataset.valid_path": Reach(lambda env: env.sft2, lambda b: b.spec.valid_dataset and b.spec.valid_dataset.args["path"]),
    "dataset.max_seqlen": Reach("256", _ds("max_seqlen")),
    "dataset.train_bs_n_seqs": Reach("8", lambda b: b.spec.dataset.batch_size),
    "dataset.valid_bs_n_seqs": Reach("8", lambda b: b.spec.valid_dataset.batch_size, needs=("VALID",)),
    "exp_ctrl.eval_freq_epochs": Reach("2", _spec("eval_freq_epochs"), needs=("VALID",)),
    "exp_ctrl.eval_freq_steps": Reach("2", _spec("eval_freq_steps"), needs=("VALID",)),
    **_mb_spec("mb_spec", "trainDefault"),
}

# ------------------------------------------------------------------------------------------ gen
def _gen_server(mfc: str) -> Dict[str, Any]:
    """Options of the generation servers of a decoupled allocation: the served replica's GenServersSpec, which the
    launcher starts the servers from and the workers' client reads."""
    needs = ("allocation_mode=gen.d1m1p1+d1m1p1", "n_devices_per_node=2")

    def fleet(field):
        return lambda b: getattr(b.model_of(mfc).gen_servers, field)

    return {
        "gen_server.max_num_seqs": Reach("8", fleet("max_num_seqs"), needs=needs),
        "gen_server.routing": Reach("round_robin", fleet("routing"), needs=needs),
        "gen_server.startup_timeout_secs": Reach("30.0", fleet("startup_timeout_secs"), needs=needs),
        "gen_server.request_timeout_secs": Reach("60.0", fleet("request_timeout_secs"), needs=needs),
        "gen_server.health_timeout_secs": Reach("5.0", fleet("health_timeout_secs"), needs=needs),
        "gen_server.extra": Reach('{"compile_decode": true}', fleet("extra"), expect=lambda x: json.loads(x),
                                  needs=needs),
    }


GEN: Dict[str, Any] = {
    **_model_options("model", "default", trains=False, offload=Reach("true", lambda b: b.model("default").offload)),
    "dataset.path": Reach(lambda env: env.prompts2, _ds("path")),
    "dataset.max_prompt_len": Reach("128", _ds("max_prompt_len")),
    "dataset.train_bs_n_seqs": Reach("8", lambda b: b.spec.dataset.batch_size),
    **_sampling("gen", "gen"),
    **_gen_server("gen"),
    "gen_server.weight_transport": Refused("group"),  # no trained weights to move
    "gen.temperature": Reach("0.7", _gconfig("gen", "temperature")),
    "gen.n": Reach("2", _gconfig("gen", "n")),
    **_mb_spec("mb_spec", "gen"),
    "output_file": Reach(lambda env: os.path.join(env.root2, "out.jsonl"), _attrs("gen.output_file"),
                         expect=lambda v: v + ".part"),
    "use_chat_template": Reach("false", _ds("use_chat_template")),
}

# ------------------------------------------------------------------------------------------ ppo-math
PPO_MFCS = ("actor_gen", "actor_train", "ref_inf", "rew_inf", "critic_inf", "critic_train")
MANUAL = ("allocation_mode=manual", "n_devices_per_node=2", *(f"{m}.device_mesh=localhost:0" for m in PPO_MFCS),
          *(f"{m}.parallel=d1m1p1" for m in PPO_MFCS))
TWO_CRITIC_LAYOUTS = ("ppo.value_norm=false",)  # value_norm needs critic_inf and critic_train on one layout


def _placement(mfc: str, manual: Tuple[str, ...] = MANUAL) -> Dict[str, Any]:
    needs = manual + (TWO_CRITIC_LAYOUTS if mfc.startswith("critic") else ())
    return {f"{mfc}.device_mesh": Reach("localhost:1", lambda b: b.model_of(mfc).ranks, expect=[1], needs=needs),
            f"{mfc}.parallel": Reach("d2m1p1", lambda b: b.model_of(mfc).layout.dp, expect=2, needs=needs,
                                     with_=(f"{mfc}.device_mesh=localhost:0,1",))}


def _ppo_both(k: str, v: str) -> Reach:
    """Read by the advantage computation of the actor and of the critic."""
    return Reach(v, _attrs(f"actor_train.cfg.{k}", f"critic_train.cfg.{k}"), expect=lambda x: _n(x, 2))


PPO: Dict[str, Any] = {
    **TRAINING,
    "param_realloc": Reach("disk", _spec("param_realloc")),
    **_gen_server("actor_gen"),
    "gen_server.weight_transport": Reach("group", lambda b: b.model_of("actor_gen").gen_servers.weight_transport,
                                         needs=("allocation_mode=gen.d1m1p1+d1m1p1", "n_devices_per_node=2")),
    **_model_options("actor", "actor", trains=True, offload=Reach(  # the actor's generation replica
        "true", lambda b: b.model_of("actor_gen").offload,
        needs=("allocation_mode=actor_gen:d2m1p1,*:d1m1p1", "n_devices_per_node=2"))),
    **_model_options("critic", "critic", trains=True, offload=Reach(  # the critic's inference replica
        "true", lambda b: b.model_of("critic_inf").offload,
        needs=("allocation_mode=critic_inf:d2m1p1,*:d1m1p1", "n_devices_per_node=2", *TWO_CRITIC_LAYOUTS))),
    **_model_options("ref", "ref", trains=False, offload=Reach("true", lambda b: b.model("ref").offload)),
    "use_critic": Reach("false", lambda b: (b.iface("actor_train").use_critic, "critic_train" in b.ifaces),
                        expect=(False, False)),
    "dataset.path": Reach(lambda env: env.math2, _ds("path")),
    "dataset.max_prompt_len": Reach("128", _ds("max_prompt_len")),
    "dataset.train_bs_n_seqs": Reach("8", lambda b: b.spec.dataset.batch_size),
    "use_chat_template": Reach("false", _ds("use_chat_template")),
    "prompt_template": Reach("Q: {prompt}", _ds("prompt_template")),
    "group_size": Reach("2", _attrs("actor_gen.gconfig.n", "actor_train.group_size"), expect=lambda x: _n(x, 2)),
    # the reward interface
    "reward.allow_last_number": Reach("true", _attrs("rew_inf.allow_last_number")),
    # rw-math scores unfinished answers wrong, reading actor_gen's seq_no_eos_mask
    "reward.unfinished_as_wrong": Reach("true", lambda b: (b.iface("rew_inf").unfinished_as_wrong,
                                                           "seq_no_eos_mask" in b.mfc("rew_inf").input_keys),
                                        expect=(True, True)),
    "reward.correct_reward": Reach("3.0", _attrs("rew_inf.correct_reward")),
    "reward.wrong_reward": Reach("-1.0", _attrs("rew_inf.wrong_reward")),
    "reward.timeout_secs": Reach("2.0", _attrs("rew_inf.timeout_secs")),
    "ppo.reward_output_scaling": Reach("2.0", _attrs("rew_inf.reward_output_scaling")),
    "ppo.reward_output_bias": Reach("1.0", _attrs("rew_inf.reward_output_bias")),
    # actor generation: the engine's options
    **_sampling("ppo.gen", "actor_gen"),
    # the sampling temperature is also that of the log-probs of training and of the reference
    "ppo.gen.temperature": Reach("0.7", _attrs("actor_gen.gconfig.temperature", "actor_train.temperature",
                                               "ref_inf.temperature"), expect=lambda x: _n(x, 3)),
    # PPO
    **{f"ppo.{k}": _ppo_both(k, v) for k, v in (("ppo_n_minibatches", "2"), ("kl_ctl", "0.3"), ("discount", "0.9"),
                                                 ("gae_lambda", "0.95"), ("max_reward_clip", "10.0"),
                                                 ("mask_too_long", "true"))},
    **{f"ppo.{k}": Reach(v, _attrs(f"actor_train.cfg.{k}")) for k, v in (
        ("kl_loss_coef", "0.1"), ("eps_clip", "0.3"), ("c_clip", "3.0"), ("entropy_coef", "0.01"), ("adv_norm", "false"))},
    "ppo.group_adv_norm": Reach("true", _attrs("actor_train.cfg.group_adv_norm"), needs=("group_size=2",)),
    "ppo.skip_zero_advantage": Reach("true", _attrs("actor_train.cfg.skip_zero_advantage"),
                                     needs=("ppo.kl_loss_coef=0",)),
    "ppo.value_eps_clip": Reach("0.5", _attrs("critic_train.cfg.value_eps_clip")),
    "ppo.value_norm": Reach("false", _attrs("critic_train.cfg.value_norm", "critic_inf.cfg.value_norm"),
                            expect=lambda x: _n(x, 2)),
    **{k: v for m in PPO_MFCS for k, v in _placement(m).items()},
    **{k: v for m in PPO_MFCS if m != "rew_inf" for k, v in _mb_spec(f"{m}.mb_spec", m).items()},
}

PPO["ppo.behav_imp_weight_cap"] = Refused("2.0")  # ppo-math trains on samples of the trained weights
# the algorithm variants (docs/algorithms.md): the actor's step reads them; the advantages' options the critic's too
PPO.update({
    **{f"ppo.{k}": Reach(v, _attrs(f"actor_train.cfg.{k}")) for k, v in (
        ("policy_loss", "gspo"), ("eps_clip_higher", "0.28"), ("loss_agg_mode", "seq-mean-token-sum-norm"),
        ("kl_loss_estimator", "k2"), ("mismatch_cap", "3.0"))},
    "ppo.adv_estimator": Reach("rloo", _attrs("actor_train.cfg.adv_estimator"), needs=("use_critic=false", "group_size=2")),
    **{f"ppo.{k}": _ppo_both(k, v) for k, v in (("kl_estimator", "k3"), ("overlong_tokens", "8"),
                                                 ("overlong_penalty_factor", "0.5"))},
    # the trainer's log-probs of the generated tokens come from actor_inf
    "ppo.mismatch_correction": Reach("tis", lambda b: ("actor_inf" in b.ifaces, b.iface("actor_train").cfg.mismatch_correction),
                                     expect=lambda v: (True, v)),
    # the master refills the batch (realhf.system.trainer.dynamic_sampling)
    "ppo.dynamic_sampling": Reach("true", lambda b: b.spec.dynamic_sampling is not None, expect=True,
                                  needs=("group_size=2",)),
})


# ------------------------------------------------------------------------------------------ async-ppo-math
def _rollout(field):
    return lambda b: getattr(b.spec.rollout, field)


def _rollout_ds(arg):
    return lambda b: b.spec.rollout.dataset.args[arg]


def _gconf(k):
    return lambda b: b.spec.rollout.gconfig[k]


def _rollout_reward(b):
    from realhf.impl.workflow.rewards import load_reward_fn

    return load_reward_fn(b.spec.rollout.reward_fn, **b.spec.rollout.reward_args)


def _fleet(field):
    return lambda b: getattr(b.spec.served().gen_servers, field)


ASYNC_ALLOC = "gen.d2m1p1+d1m1p1"  # a base with three device slots, so the trainer's layout can change
ASYNC: Dict[str, Any] = {
    **{k: v for k, v in PPO.items() if not k.startswith(("actor_gen.", "rew_inf.", "ppo.gen.", "gen_server.", "dataset.",
                                                            "critic_inf.", "critic_train.", "actor_train.", "ref_inf.",
                                                            "reward."))
       and k not in ("param_realloc", "actor.offload", "critic.offload", "use_chat_template", "prompt_template",
                     "group_size", "ppo.reward_output_scaling", "ppo.reward_output_bias", "ppo.behav_imp_weight_cap")},
    # the trainer: the same spec fields and interfaces as ppo-math
    "allocation_mode": Reach("gen.d1m1p1+d2m1p1", lambda b: b.model("actor").layout.dp, expect=2,
                             needs=("n_devices_per_node=3", f"allocation_mode={ASYNC_ALLOC}")),
    "n_nodes": Reach("2", lambda b: b.spec.device_slots(), expect=4, with_=("allocation_mode=gen.d2m1p1+d2m1p1",)),
    "n_devices_per_node": Reach("4", lambda b: b.spec.device_slots(), expect=4,
                                with_=("allocation_mode=gen.d2m1p1+d2m1p1",)),
    "param_realloc": Reach("memory", _fleet("param_realloc")),  # the rollout manager has the servers map them
    "actor.offload": Refused("true"),
    "critic.offload": Reach("true", lambda b: b.model_of("critic_inf").offload,
                            needs=("n_devices_per_node=3", "allocation_mode=gen.d1m1p1+critic_inf:d2m1p1,*:d1m1p1",
                                   *TWO_CRITIC_LAYOUTS)),
    **{f"{m}.{f}": Refused(v) for m in PPO_MFCS + ("actor_inf",) for f, v in (("device_mesh", "localhost:1"),
                                                                              ("parallel", "d1m1p1"))},
    **{f"actor_gen.mb_spec.{k}": Refused(v) for k, v in (("n_mbs", "2"), ("max_tokens_per_mb", "4096"))},
    **{k: v for m in ("actor_train", "ref_inf", "critic_inf", "critic_train", "actor_inf")
       for k, v in _mb_spec(f"{m}.mb_spec", m).items()},
    # the generation servers
    **{f"gen_server.{k}": Reach(v, _fleet(k)) for k, v in (("max_num_seqs", "8"), ("routing", "round_robin"),
                                                         ("startup_timeout_secs", "30.0"),
                                                         ("request_timeout_secs", "60.0"),
                                                         ("health_timeout_secs", "5.0"))},
    "gen_server.extra": Reach('{"compile_decode": true}', _fleet("extra"), expect=lambda x: json.loads(x)),
    "gen_server.weight_transport": Refused("group"),  # in memory only by sharing (param_realloc above)
    # the rollout workers: prompts, sampling, rewards, workflow
    "dataset.path": Reach(lambda env: env.math2, _rollout_ds("path")),
    "dataset.max_prompt_len": Reach("128", _rollout_ds("max_prompt_len")),
    "dataset.train_bs_n_seqs": Reach("8", lambda b: (b.spec.dataset.batch_size, b.spec.rollout.batch_size),
                                     expect=lambda x: _n(x, 2)),
    "use_chat_template": Reach("false", _rollout_ds("use_chat_template")),
    "prompt_template": Reach("Q: {prompt}", _rollout_ds("prompt_template")),
    "group_size": Reach("2", lambda b: (b.spec.rollout.gconfig["n"], b.iface("actor_train").group_size),
                        expect=lambda x: _n(x, 2)),
    **{k: Reach(v, lambda b, a=a: b.spec.rollout.reward_args[a]) for k, v, a in (
        ("reward.allow_last_number", "true", "allow_last_number"), ("reward.correct_reward", "3.0", "correct_reward"),
        ("reward.wrong_reward", "-1.0", "wrong_reward"), ("reward.timeout_secs", "2.0", "timeout_secs"))},
    # the reward the rollout workers build from the spec (as RolloutWorker.setup does) scores unfinished answers wrong
    "reward.unfinished_as_wrong": Reach("true", lambda b: _rollout_reward(b).unfinished_as_wrong),
    "ppo.reward_output_scaling": Reach("2.0", _rollout("reward_output_scaling")),
    "ppo.reward_output_bias": Reach("1.0", _rollout("reward_output_bias")),
    **{f"ppo.gen.{k}": Reach(v, _gconf(k)) for k, v in (("max_new_tokens", "64"), ("min_new_tokens", "2"),
                                                        ("greedy", "true"), ("top_p", "0.9"), ("top_k", "5"),
                                                        ("seed", "11"))},
    "ppo.gen.stop_token_ids": Reach("[5,6]", _gconf("stop_token_ids")),
    "ppo.gen.compile_decode": Refused("true"),
    "ppo.gen.cuda_graph": Refused("false"),
    "ppo.gen.kv_cache_dtype": Refused("float16"),
    "ppo.gen.temperature": Reach("0.7", lambda b: (b.spec.rollout.gconfig["temperature"], b.iface("actor_train").temperature,
                                                   b.iface("ref_inf").temperature), expect=lambda x: _n(x, 3)),
    "ppo.behav_imp_weight_cap": Reach("2.0", _attrs("actor_train.cfg.behav_imp_weight_cap")),
    "async_rl.max_head_offpolicyness": Reach("2", _rollout("max_head_offpolicyness")),
    "async_rl.max_concurrent_rollouts": Reach("5", _rollout("max_concurrent_rollouts")),
    "async_rl.n_rollout_workers": Reach("2", _rollout("n_workers")),
    "async_rl.workflow": Reach("multi_turn", _rollout("workflow"),  # its two turns fit the model's positions
                               needs=("use_critic=false", "ppo.gen.max_new_tokens=64")),
    "async_rl.workflow_args": Reach('{"max_turns": 3}', _rollout("workflow_args"), expect=lambda x: json.loads(x)),
    "async_rl.reward_fn": Reach("realhf.reward:MathVerifier", _rollout("reward_fn")),  # any importable callable
    "async_rl.dynamic_filtering": Reach("true", _rollout("dynamic_filtering")),
    "ppo.dynamic_sampling": Reach("true", _rollout("dynamic_filtering"), needs=("group_size=2",)),
    # loglinear: no actor_inf, and actor_train interpolates the proximal log-probs itself
    "async_rl.prox_logp": Reach("loglinear", lambda b: ("actor_inf" in b.ifaces, b.iface("actor_train").prox_logp),
                                expect=lambda v: (False, v)),
    "async_rl.episode_timeout_secs": Reach("60.0", _rollout("episode_timeout_secs")),
    "async_rl.max_episode_retries": Reach("5", _rollout("max_episode_retries")),
    "async_rl.weight_update": Reach("inflight", _rollout("weight_update")),  # the manager's interrupt flag
}
# the critic's options of ppo-math, which read the critic's interfaces as they are
ASYNC.update({k: v for k, v in PPO.items() if k.startswith("ppo.") and k not in ASYNC and "gen." not in k})

# ------------------------------------------------------------------------------------------ rw, dpo; ppo-math's reward model
REWARD_MODEL = ("reward.type=model", "RM")  # a reward model scores in rew_inf
PPO.update({
    # rew_inf runs the reward model (the rw interface) instead of the grader (rw-math)
    "reward.type": Reach("model", lambda b: b.mfc("rew_inf").interface_impl, expect="rw", with_=("RM",)),
    "reward.model.path": Reach(lambda env: env.rm2, lambda b: b.model("reward").path, needs=REWARD_MODEL),
    **{f"reward.model.{k}": Reach(v, lambda b, k=k: getattr(b.model("reward"), k), needs=REWARD_MODEL)
       for k, v in (("dtype", "bfloat16"), ("offload", "true"), ("compile", "true"))},
    **{k: dataclasses.replace(v, needs=REWARD_MODEL) for k, v in _mb_spec("rew_inf.mb_spec", "rew_inf").items()},
})
# the rollout workers score with async_rl.reward_fn: a reward model has no use there
ASYNC.update({"reward.type": Refused("model"), "reward.model.path": Refused(lambda env: env.rm),
              **{f"reward.model.{k}": Refused(v) for k, v in (("dtype", "bfloat16"), ("offload", "true"),
                                                             ("compile", "true"))},
              **{f"rew_inf.mb_spec.{k}": Refused(v) for k, v in (("n_mbs", "2"), ("max_tokens_per_mb", "4096"))}})


def _pairs_options() -> Dict[str, Any]:
    """The preference dataset: the DatasetSpec of the rw / dpo run, which the workers build the dataset from."""
    return {"dataset.train_path": Reach(lambda env: env.pairs2, _ds("path")),
            "dataset.valid_path": Reach(lambda env: env.pairs2,
                                        lambda b: b.spec.valid_dataset and b.spec.valid_dataset.args["path"]),
            "dataset.max_seqlen": Reach("256", _ds("max_seqlen")),
            "dataset.use_chat_template": Reach("true", _ds("use_chat_template")),
            "dataset.train_bs_n_seqs": Reach("8", lambda b: b.spec.dataset.batch_size),
            "dataset.valid_bs_n_seqs": Reach("8", lambda b: b.spec.valid_dataset.batch_size, needs=("PAIRS_VALID",)),
            "exp_ctrl.eval_freq_epochs": Reach("2", _spec("eval_freq_epochs"), needs=("PAIRS_VALID",)),
            "exp_ctrl.eval_freq_steps": Reach("2", _spec("eval_freq_steps"), needs=("PAIRS_VALID",))}


RW: Dict[str, Any] = {
    **{k: v for k, v in TRAINING.items() if not k.startswith("auto_eval.")},  # a reward model is not evaluated so
    **_model_options("model", "default", trains=True, offload=Refused("true")),
    **_pairs_options(),
    **_mb_spec("mb_spec", "trainDefault"),
}
DPO_MFCS = ("actor_train", "ref_inf")
DPO_MANUAL = ("allocation_mode=manual", "n_devices_per_node=2", *(f"{m}.device_mesh=localhost:0" for m in DPO_MFCS),
              *(f"{m}.parallel=d1m1p1" for m in DPO_MFCS))
DPO: Dict[str, Any] = {
    **TRAINING,
    **_model_options("actor", "actor", trains=True, offload=Refused("true")),
    **_model_options("ref", "ref", trains=False, offload=Reach("true", lambda b: b.model("ref").offload)),
    **_pairs_options(),
    "dpo.beta": Reach("0.5", _attrs("actor_train.beta", "ref_inf.beta"), expect=lambda x: _n(x, 2)),
    **{k: v for m in DPO_MFCS for k, v in {**_mb_spec(f"{m}.mb_spec", m), **_placement(m, DPO_MANUAL)}.items()},
}

TABLES = {"sft": SFT, "gen": GEN, "ppo-math": PPO, "async-ppo-math": ASYNC, "rw": RW, "dpo": DPO}
# the options each experiment needs to build at all (required paths; the tiny model has 512 positions)
BASE_ARGS = {
    "sft": lambda env: [f"model.path={env.model}", f"dataset.train_path={env.sft}", "dataset.max_seqlen=512"],
    "gen": lambda env: [f"model.path={env.model}", f"dataset.path={env.prompts}"],
    "ppo-math": lambda env: [f"actor.path={env.model}", f"dataset.path={env.math}"],
    "async-ppo-math": lambda env: [f"actor.path={env.model}", f"dataset.path={env.math}", "n_devices_per_node=2",
                                   "allocation_mode=gen.d1m1p1+d1m1p1"],
    "rw": lambda env: [f"model.path={env.model}", f"dataset.train_path={env.pairs}", "dataset.max_seqlen=512"],
    "dpo": lambda env: [f"actor.path={env.model}", f"dataset.train_path={env.pairs}", "dataset.max_seqlen=512"],
}
NEEDS = {"VALID": lambda env: f"dataset.valid_path={env.sft}",  # placeholders of ``needs`` filled from the files
         "PAIRS_VALID": lambda env: f"dataset.valid_path={env.pairs}",
         "RM": lambda env: f"reward.model.path={env.rm}"}
