"""ppo-math end to end on a tiny model: PPO (critic + KL to a reference) and GRPO through the launcher."""
from realhf.testing import read_stats, run_quickstart

STAT_KEYS = ("task_reward", "importance_weight", "actor_clip_ratio", "actor_loss", "ppo_approx_kl", "kl_reward",
             "final_reward", "advantage", "avg_seq_len", "avg_prompt_len", "n_tokens", "n_valid_tokens", "n_seqs",
             "no_eos_ratio", "actor_gen/time", "rew_inf/time", "ref_inf/time", "critic_inf/time", "actor_train/time",
             "critic_train/time", "critic_loss")


def run(model, d, exp, layout, *extra):
    import re

    n = 1
    for x in re.findall(r"\d+", layout):
        n *= int(x)
    args = ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4", "group_size=4",
            "ppo.gen.max_new_tokens=6", "ppo.gen.temperature=1.0", "ppo.ppo_n_minibatches=2", "use_chat_template=false",
            "prompt_template={prompt}", "reward_allow_last_number=true", "actor.optimizer.lr=1e-3",
            "critic.optimizer.lr=1e-3", f"fileroot={d}", f"experiment_name={exp}", f"allocation_mode={layout}",
            f"n_devices_per_node={n}", *extra]
    p = run_quickstart(args)
    assert p.returncode == 0, p.stderr[-4000:]
    return read_stats(d, exp)


def test_ppo_with_critic_first_step_same_in_every_layout(tiny_math_run):
    """Same seed: the first PPO step's stats agree under d1m1p1, d1m2p1 and d2m1p1.

    Sampling is seeded per sample (not per batch), so generation is layout independent. Token-level
    stats are compared exactly; float stats within 1e-4 (tensor parallelism changes summation order).
    One PPO minibatch: with several, the minibatches of a data-parallel run hold other samples than a
    single process's, so the later minibatches (after the first update) legitimately differ.
    """
    model, d = tiny_math_run
    runs = {lay: run(model, d, f"ppo-{lay}", lay, "use_critic=true", "ppo.kl_ctl=0.1", "ppo.ppo_n_minibatches=1",
                     "exp_ctrl.benchmark_steps=1")[0]
            for lay in ("d1m1p1", "d1m2p1", "d2m1p1")}
    ref = runs["d1m1p1"]
    for k in STAT_KEYS:
        assert k in ref, f"stat {k} missing from stats.jsonl"
    for lay, st in runs.items():
        for k in ("n_tokens", "n_valid_tokens", "n_seqs", "avg_seq_len", "no_eos_ratio", "task_reward"):
            assert st[k] == ref[k], f"{lay}: {k}={st[k]} vs {ref[k]}"
        for k in ("importance_weight", "actor_loss", "ppo_approx_kl", "kl_reward", "final_reward", "critic_loss"):
            assert abs(st[k] - ref[k]) < 1e-4 * max(1.0, abs(ref[k])), f"{lay}: {k}={st[k]} vs {ref[k]}"


def test_grpo_runs_and_updates(tiny_math_run):
    model, d = tiny_math_run
    st = run(model, d, "grpo", "d1m1p1", "use_critic=false", "ppo.kl_ctl=0", "ppo.group_adv_norm=true",
             "exp_ctrl.benchmark_steps=3")
    assert len(st) == 3
    assert all(s["n_seqs"] == 16 for s in st)
    assert "critic_loss" not in st[0] and "ref_inf/time" not in st[0]
    for s in st:
        assert s["importance_weight"] > 0 and s["n_valid_tokens"] > 0
        # every MFC that runs a model reports the memory model's estimate beside the peak it measured (on CPU the
        # process's resident memory, which the estimate's runtime part stands for)
        for mfc in ("actor_gen", "actor_train"):
            est, peak = s[f"{mfc}/est_mem_gib"], s[f"{mfc}/peak_mem_gib"]
            assert 0 < s[f"{mfc}/est_increase_gib"] < est and 0.25 * peak < est < 4 * peak, (mfc, est, peak)
        if s["task_reward"] == -5.0:  # every answer wrong: every group is flat, GRPO has nothing to learn from
            assert s["actor_grad_norm"] == 0.0 and s["advantage"] == 0.0
