"""The RL algorithm variants of ``ppo.*`` learn: each trains the tiny arithmetic model of ``tests/e2e/test_grpo_learns.py``
(``scripts/tiny_arith_learning.py``: a sloppy SFT start at about 30% held-out greedy accuracy) through the quickstart
launcher, from the GRPO config with the variant's options on top.

In the default suite one short run per variant (8 steps) must raise held-out accuracy and the batch reward, and show
that the variant acted (its stats); marked ``slow``, each variant's full run (40 steps) must reach the GRPO test's bar:
at least 70% held-out and 30 points above the start."""
import pytest

from realhf.testing import tiny_arith_recipe

# the full runs (slow): one per variant; the train-inference mismatch corrections ride along (TIS with GSPO, MIS with
# Dr. GRPO: here the generator is the trainer's own engine, so they must not get in the way)
VARIANTS = {
    "dr-grpo": ["ppo.group_adv_norm=false", "ppo.loss_agg_mode=seq-mean-token-sum-norm", "ppo.mismatch_correction=mis"],
    "dapo": ["ppo.eps_clip_higher=0.28", "ppo.overlong_tokens=1", "ppo.dynamic_sampling=true"],
    "gspo": ["ppo.policy_loss=gspo", "ppo.eps_clip=0.0003", "ppo.eps_clip_higher=0.0004", "ppo.mismatch_correction=tis"],
    "rloo": ["ppo.adv_estimator=rloo", "ppo.group_adv_norm=false"],
    "reinforce-pp": ["ppo.adv_estimator=reinforce++", "ppo.group_adv_norm=false", "ppo.adv_norm=true",
                     "ppo.kl_ctl=0.01", "ppo.kl_estimator=k2"],
}
# the short runs (default suite): fewer launches, RLOO's advantage with Dr. GRPO's loss
QUICK = {"rloo-dr-grpo": VARIANTS["rloo"] + VARIANTS["dr-grpo"][1:], "dapo": VARIANTS["dapo"],
         "gspo": VARIANTS["gspo"], "reinforce-pp": VARIANTS["reinforce-pp"]}
QUICK_STEPS = 8


@pytest.fixture(scope="module")
def recipe():
    return tiny_arith_recipe()


@pytest.fixture(scope="module")
def start(tiny_arith_start):
    """The SFT start (tests/conftest.py), shared with tests/e2e/test_grpo_learns.py."""
    return tiny_arith_start


def _learn(recipe, start, name, steps):
    ov = list((QUICK if steps else VARIANTS)[name])
    if steps:
        ov += [f"exp_ctrl.benchmark_steps={steps}", f"exp_ctrl.save_freq_steps={steps}"]
    res = recipe.learn("grpo", start["out"], start, ov, eval_threads=None, exp=f"{name}-{steps or 40}")
    acc = [(s["task_reward"] + 5) / 10 for s in res["stats"]]
    print(f"{name}: held-out greedy accuracy {start['heldout_acc_before']:.1%} -> {res['heldout_acc_after']:.1%} in "
          f"{res['steps']} steps ({res['seconds']}); batch accuracy {[round(a, 3) for a in acc]}")
    return res, acc


def _check_acted(name, st):
    """The variant's own mechanism ran (its stats), on every step."""
    if name == "dapo":
        assert all(s["dynamic_sampling/filled"] == 0 for s in st), st
        assert any(s["dynamic_sampling/rounds"] > 1 for s in st)  # some prompts were dropped and replaced
        # answers that reach max_new_tokens (4 here) lose reward
        assert all(s["overlong_penalty"] <= 0 for s in st) and any(s["overlong_penalty"] < 0 for s in st)
    if name in ("dr-grpo", "gspo", "rloo-dr-grpo"):  # the trainer's log-probs beside the generator's (one engine here: equal)
        assert all("actor_inf/time" in s and s["behave_logp_abs_diff"] < 1e-3 for s in st)
    if name == "reinforce-pp":
        assert all(s["kl_reward"] < 0 for s in st[1:])  # the KL penalty shapes the reward (the policy moved)


@pytest.mark.parametrize("name", list(QUICK))
def test_variant_learns_in_a_short_run(recipe, start, name):
    res, acc = _learn(recipe, start, name, QUICK_STEPS)
    st = res["stats"]
    assert res["steps"] == QUICK_STEPS and all(s["n_seqs"] == 16 * 8 for s in st)
    _check_acted(name, st)
    assert res["heldout_acc_after"] >= start["heldout_acc_before"] + 0.2, res["heldout_acc_after"]
    assert sum(acc[-4:]) / 4 >= sum(acc[:2]) / 2 + 0.05, acc


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_reaches_the_grpo_bar(recipe, start, name):
    res, acc = _learn(recipe, start, name, None)
    before, after = start["heldout_acc_before"], res["heldout_acc_after"]
    assert res["steps"] == 40
    _check_acted(name, res["stats"])
    assert after >= 0.70 and after >= before + 0.30, f"{name}: held-out greedy accuracy {before:.1%} -> {after:.1%}"
    assert res["batch_acc_last_quarter"] >= res["batch_acc_first_quarter"] + 0.10, res["batch_acc_last_quarter"]
