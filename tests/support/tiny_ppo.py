"""The short ``ppo-math`` run on the tiny math task (tests/conftest.py's ``tiny_math_run`` data) that runs on other
layouts, devices, servers and launchers are compared with step for step: GRPO-style (no critic, no KL), one PPO
minibatch, and an entropy bonus, so that even when every answer of a group is wrong (zero advantage) there is a
gradient: the parameters change every step and a stale generation replica shows in the stats."""

STEPS = 3


def ppo_args(model, d, exp, n_devices, *extra):
    """The run's quickstart arguments (``experiment_name=exp`` under ``fileroot=d``); ``extra`` is appended (later
    options win)."""
    return ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=4", "ppo.gen.max_new_tokens=6", "ppo.gen.temperature=1.0", "ppo.ppo_n_minibatches=1",
            "use_chat_template=false", "prompt_template={prompt}", "reward_allow_last_number=true",
            "actor.optimizer.lr=1e-3", "use_critic=false", "ppo.kl_ctl=0", "ppo.entropy_coef=0.05",
            f"exp_ctrl.benchmark_steps={STEPS}", f"fileroot={d}", f"experiment_name={exp}",
            f"n_devices_per_node={n_devices}", *extra]
