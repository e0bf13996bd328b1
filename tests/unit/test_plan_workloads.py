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


def _work():
    """ppo-math's workloads as the memory plan sizes them (memory_plan.workloads): prompts of BOUND tokens, the head's
    rows a sequence's answer with prompts of half the bound, a group's prompt computed once."""
    seq = BOUND + ANSWER
    body = shared_body_share(BOUND, ANSWER, GROUP)
    return {"actor_gen": Workload("generate", 8, BOUND, n=GROUP, max_new=ANSWER),
            "actor_train": Workload("train", 8 * GROUP, seq, ANSWER / (ANSWER + BOUND / 2), body),
            "rew_inf": Workload("inference", 8 * GROUP, seq, 1.0, 1.0)}


def test_shares_are_taken_again_at_the_measured_prompt_length():
    out = with_prompt_len(_work(), BOUND, 4.0)
    train = out["actor_train"]
    assert (out["actor_gen"].seq_len, train.seq_len) == (4, 4 + ANSWER)
    # the head computes the answers' rows: 16 of 20 tokens (not 16 of 144, the bound's share)
    assert train.head_share == pytest.approx(ANSWER / (ANSWER + 4))
    # the blocks compute the prompt once per group of 4: (4 + 4 * 16) / (4 * 20)
    assert train.body_share == pytest.approx((4 + GROUP * ANSWER) / (GROUP * (4 + ANSWER)))
    # a share of 1 (a per-sequence head, no shared prompt) stays 1
    assert (out["rew_inf"].head_share, out["rew_inf"].body_share) == (1.0, 1.0)


def test_the_training_calls_time_follows_the_tokens_it_computes():
    """The simulated training call at the measured prompt length is that of a workload built at that length: the
    shares of the bound (a tenth of the head's rows, a third of the blocks' tokens here) would undercount it."""
    cfg, hw = model_config("smollm2-135m"), get("h100")
    m = PlanModel("actor", cfg, Mesh(1, 1, 1, 0), "bfloat16", trains=True)
    got = with_prompt_len(_work(), BOUND, 4.0)["actor_train"]
    direct = Workload("train", 8 * GROUP, 4 + ANSWER, ANSWER / (ANSWER + 4), shared_body_share(4, ANSWER, GROUP))
    stale = Workload("train", 8 * GROUP, 4 + ANSWER, _work()["actor_train"].head_share,
                     _work()["actor_train"].body_share)

    def t(w):
        return compute_time(hw, m, PlanCall("actor_train", "actor", (), w))

    assert t(got) == pytest.approx(t(direct))
    assert t(got) > t(stale)
