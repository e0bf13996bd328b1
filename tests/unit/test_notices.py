"""Warnings a user can act on, found in step stats: each reported once."""
from realhf.system.transport.notices import Notices


def test_each_notice_once_and_only_when_it_applies():
    n = Notices()
    n.check(1, {"no_eos_ratio": 0.2, "task_reward": 1.0, "task_reward_std": 0.5, "n_verify_timeout": 0.0,
                "actor_skipped_nonfinite": 0.0})
    assert n.messages == []
    n.check(2, {"no_eos_ratio": 0.75, "task_reward": -5.0, "task_reward_std": 0.0, "n_verify_timeout": 3.0})
    n.check(3, {"no_eos_ratio": 0.9, "task_reward": -5.0, "task_reward_std": 0.0, "n_verify_timeout": 1.0})
    assert len(n.messages) == 3, n.messages
    assert "step 2: 75% of the sampled answers hit the max-new-tokens limit" in n.messages[0]
    assert "every answer of the batch got the same reward (-5.0)" in n.messages[1]
    assert "grading timed out on 3 answers" in n.messages[2]
    # a skipped non-finite update is reported each time the count grows, not at every step
    for step, count in ((4, 1.0), (5, 1.0), (6, 2.0)):
        n.check(step, {"critic_skipped_nonfinite": count})
    skips = [m for m in n.messages if "non-finite" in m]
    assert len(skips) == 2 and "critic_skipped_nonfinite = 2" in skips[1]
    n.add("data_skipped", "x.jsonl: skipped 1 of 3 rows")
    n.add("data_skipped", "x.jsonl: skipped 1 of 3 rows")
    assert n.messages.count("x.jsonl: skipped 1 of 3 rows") == 1
