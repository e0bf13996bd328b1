"""The work the step simulator is given for a run: the memory plan's workloads (at the options' bounds) taken at the
prompts' measured length, as the planner's estimate of a run does (:func:`realhf.apps.planning.with_prompt_len`)."""
from __future__ import annotations

import pytest

from realhf.apps.planning import with_prompt_len
from realhf.plan.comm_cost import Mesh
from realhf.plan.fit import Workload, shared_body_share
from realhf.plan.hardware import get
from realhf.plan.shapes import model_config
from realhf.plan.simulate import PlanCall, PlanModel, compute_time

BOUND, ANSWER, GROUP = 256, 16, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """ppo-math's workloads as the memory plan sizes them (memory_plan.workloads): prompts of BOUND tokens, answers
    of ANSWER, groups of GROUP, a critic (its value head on every token)."""
    from realhf.api.quickstart.entry import parse_cli
    from realhf.experiments import registered
    from realhf.experiments.memory_plan import workloads
    from realhf.impl.model.tiny import ensure_tiny_model

    data = tmp_path_factory.mktemp("work") / "math.jsonl"
    data.write_text("")
    registered()
    _, cfg = parse_cli(["ppo-math", f"actor.path={ensure_tiny_model('qwen2')}", f"dataset.path={data}",
                        f"dataset.max_prompt_len={BOUND}", f"ppo.gen.max_new_tokens={ANSWER}", f"group_size={GROUP}",
                        "dataset.train_bs_n_seqs=8", "use_critic=true"])
    return workloads(cfg)


def test_shares_are_taken_again_at_the_measured_prompt_length(work):
    out = with_prompt_len(work, BOUND, 4.0)
    train = out["actor_train"]
    assert (out["actor_gen"].seq_len, train.seq_len) == (4, 4 + ANSWER)
    # the head computes the answers' rows: 16 of 20 tokens (not 16 of 144, the bound's share)
    assert train.head_share == pytest.approx(ANSWER / (ANSWER + 4))
    # the blocks compute the prompt once per group of 4: (4 + 4 * 16) / (4 * 20)
    assert train.body_share == pytest.approx((4 + GROUP * ANSWER) / (GROUP * (4 + ANSWER)))
    # a share of 1 (the critic's value head on every token) stays 1; its blocks share the prompt as the actor's do
    assert out["critic_train"].head_share == 1.0
    assert out["critic_train"].body_share == pytest.approx(train.body_share)


def test_the_training_calls_time_follows_the_tokens_it_computes(work):
    """The simulated training call at the measured prompt length is that of a workload built at that length: the
    shares of the bound (a ninth of the head's rows, under a third of the blocks' tokens here) would undercount it."""
    cfg, hw = model_config("smollm2-135m"), get("h100")
    m = PlanModel("actor", cfg, Mesh(1, 1, 1, 0), "bfloat16", trains=True)
    bound = work["actor_train"]
    got = with_prompt_len(work, BOUND, 4.0)["actor_train"]
    direct = Workload("train", bound.seqs, 4 + ANSWER, ANSWER / (ANSWER + 4), shared_body_share(4, ANSWER, GROUP),
                      minibatches=bound.minibatches)
    stale = Workload("train", bound.seqs, 4 + ANSWER, bound.head_share, bound.body_share,
                     minibatches=bound.minibatches)

    def t(w):
        return compute_time(hw, m, PlanCall("actor_train", "actor", (), w))

    assert t(got) == pytest.approx(t(direct))
    assert t(got) > t(stale)


def test_a_rule_based_reward_grades_every_answer_of_the_step(tmp_path):
    """ppo-math's rew_inf (the rule-based grader, no weights) gets every generated answer of the step to grade, and a
    step estimated on a cluster without a measured grading rate counts nothing for it."""
    from realhf.api.quickstart.entry import parse_cli
    from realhf.apps.planning import context
    from realhf.experiments import registered
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model
    from realhf.plan.simulate import plan_of

    data = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(16, seed=3, kind="easy"), str(data))
    registered()
    _, cfg = parse_cli(["ppo-math", f"actor.path={ensure_tiny_model('qwen2')}", f"dataset.path={data}",
                        f"group_size={GROUP}", "dataset.train_bs_n_seqs=8", "use_critic=false", "ppo.kl_ctl=0",
                        "allocation_mode=d2m1p1", "n_devices_per_node=2"])
    ctx = context("ppo-math", cfg, ("h800", 2, 1))
    plan = plan_of(ctx.spec, ctx.cfgs, ctx.work, ctx.hw.device)
    reward = next(c for c in plan.calls if c.name == "rew_inf")
    assert reward.work is None and reward.answers == 8 * GROUP
    train = next(c for c in plan.calls if c.name == "actor_train")
    assert train.answers == 0
    # its inputs arrive one message per sample (a prompt with its answers) and key, from each parent
    assert len(train.messages) == len(train.parents) and all(n > 0 and n % 8 == 0 for n in train.messages)
    assert compute_time(ctx.hw, plan.model(reward.model), reward) == 0.0
