"""``ppo.skip_zero_advantage``: actor_train runs only on the prompts whose answers carry a nonzero advantage (GRPO:
the groups whose rewards differ). Flat groups add nothing to the policy gradient, so the kept step's gradient is
the full step's gradient scaled by (all loss tokens / kept loss tokens); a step where every group is flat makes
no update; data-parallel ranks that keep different numbers (or none) still run the same collectives."""
import pytest
import torch

from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

from support.ppo_samples import grpo_sample

GROUP = 2


def _sample(vocab, rewards, seed=3):
    """One sample per prompt, each with GROUP answers; ``rewards`` per answer (prompt-major)."""
    return grpo_sample(vocab, rewards, GROUP, seed)


def _step(path, grid, sample, skip, lr=1e-3):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface, answer_loss_mask

    cfg = PPOHyperparameters(ppo_n_minibatches=1, kl_ctl=0.0, adv_norm=False, group_adv_norm=True,
                             skip_zero_advantage=skip)
    m = build_from_hf(path, grid=grid)
    start = m.flat.detach().clone()
    engine = TrainEngine(m, OptimizerConfig(lr=lr, gradient_clipping=0.0), 10)
    model = Model(name="actor", engine=engine, tokenizer=None, grid=grid, path="")
    st = PPOActorInterface(cfg, group_size=GROUP, use_critic=False, seed=1).train_step(
        model, sample, MicroBatchSpec(max_tokens_per_mb=24))
    return st, start, m.flat.detach().clone(), engine.step_count, float(answer_loss_mask(sample).sum())


def _single(path):
    from realhf.base.topology import ParallelDims, ParallelGrid

    grid = ParallelGrid(ParallelDims(1, 1, 1))
    from realhf.impl.model.conversion.hf_io import read_hf_config

    vocab = read_hf_config(path)["vocab_size"]
    # prompt 0 flat (both right), prompt 1 mixed, prompt 2 flat (both wrong), prompt 3 mixed
    mixed = _sample(vocab, [5.0, 5.0, 5.0, -5.0, -5.0, -5.0, -5.0, 5.0])
    full, _, _, steps_full, n_all = _step(path, grid, mixed, skip=False)
    kept, start, after, steps_kept, _ = _step(path, grid, mixed, skip=True)
    n_kept = float(_step(path, grid, mixed.take([1, 3]), skip=False)[4])
    flat = _step(path, grid, _sample(vocab, [5.0, 5.0, -5.0, -5.0]), skip=True)
    return dict(full=full, kept=kept, steps=(steps_full, steps_kept), n_all=n_all, n_kept=n_kept,
                moved=float((after - start).abs().max()), flat_stats=flat[0],
                flat_moved=float((flat[2] - flat[1]).abs().max()), flat_steps=flat[3])


def test_skip_keeps_only_groups_with_signal_and_scales_the_gradient():
    path = ensure_tiny_model("qwen2")
    (r,) = run_distributed(_single, 1, path)
    full, kept = r["full"], r["kept"]
    assert kept["actor_kept_frac"] == 0.5 and "actor_kept_frac" not in full
    assert r["steps"] == (1, 1) and r["moved"] > 0
    assert 0 < r["n_kept"] < r["n_all"]
    # the flat groups have zero gradient: the kept step is the full one, its token mean over fewer tokens
    expected = full["actor_grad_norm"] * r["n_all"] / r["n_kept"]
    assert full["actor_grad_norm"] > 0
    assert abs(kept["actor_grad_norm"] - expected) <= 1e-4 * expected, (kept["actor_grad_norm"], expected)
    # batch statistics still describe every answer of the batch
    assert kept["n_seqs"] == full["n_seqs"] == 8 and kept["task_reward"] == full["task_reward"]
    # every group flat: no update at all (no optimizer step, parameters unchanged)
    assert r["flat_stats"]["actor_kept_frac"] == 0.0 and r["flat_steps"] == 0 and r["flat_moved"] == 0.0
    assert r["flat_stats"]["actor_grad_norm"] == 0.0


def _dp(path):
    import torch.distributed as dist

    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import read_hf_config

    grid = ParallelGrid(ParallelDims(2, 1, 1))
    vocab = read_hf_config(path)["vocab_size"]
    rank = dist.get_rank()
    # rank 0 holds only flat groups, rank 1 one mixed group of two
    rewards = [5.0, 5.0, -5.0, -5.0] if rank == 0 else [5.0, -5.0, 5.0, 5.0]
    st, start, after, steps, _ = _step(path, grid, _sample(vocab, rewards, seed=3 + rank), skip=True)
    return dict(rank=rank, kept=st["actor_kept_frac"], steps=steps, moved=float((after - start).abs().max()),
                params=after)


def test_skip_across_data_parallel_ranks_that_keep_none_or_some():
    path = ensure_tiny_model("qwen2")
    res = sorted(run_distributed(_dp, 2, path), key=lambda r: r["rank"])
    for r in res:
        assert r["kept"] == 0.25 and r["steps"] == 1 and r["moved"] > 0
    torch.testing.assert_close(res[0]["params"], res[1]["params"], atol=0, rtol=0)


@pytest.mark.parametrize("term", ["kl_loss_coef", "entropy_coef"])
def test_skip_refused_with_loss_terms_that_train_every_answer(term):
    from realhf.api.quickstart.ppo_config import PPOHyperparameters

    with pytest.raises(ValueError, match="skip_zero_advantage=true needs ppo.kl_loss_coef=0 and ppo.entropy_coef"):
        PPOHyperparameters(skip_zero_advantage=True, **{term: 0.1})


def _proximal(path):
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf, read_hf_config
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface

    grid = ParallelGrid(ParallelDims(1, 1, 1))
    model = Model(name="actor", engine=InferenceEngine(build_from_hf(path, grid=grid)), tokenizer=None, grid=grid,
                  path="")
    sample = _sample(read_hf_config(path)["vocab_size"], [5.0, 5.0, 5.0, -5.0, -5.0, -5.0, -5.0, 5.0])
    spec = MicroBatchSpec(max_tokens_per_mb=24)

    def lp(skip, proximal):
        cfg = PPOHyperparameters(kl_ctl=0.0, adv_norm=False, group_adv_norm=True, skip_zero_advantage=skip)
        iface = PPOActorInterface(cfg, group_size=GROUP, use_critic=False, seed=1, proximal=proximal)
        return iface.inference(model, sample, spec).data["logprobs"]

    lens = [sum(x) for x in sample.seqlens["packed_input_ids"]]
    return dict(full=lp(True, False), trained_only=lp(True, True), no_skip=lp(False, True), lens=lens)


def test_proximal_logprobs_only_for_the_trained_samples():
    """actor_inf (the proximal log-probs of decoupled PPO) under skip_zero_advantage computes the samples actor_train
    trains (the groups whose rewards differ) and leaves zeros for the others, which are never trained."""
    (r,) = run_distributed(_proximal, 1, ensure_tiny_model("qwen2"))
    full, part = r["full"].split(r["lens"]), r["trained_only"].split(r["lens"])
    for i, (f, p) in enumerate(zip(full, part)):
        if i in (1, 3):  # mixed groups: trained
            assert bool((f != 0).any())
            torch.testing.assert_close(p, f, rtol=1e-5, atol=1e-6)
        else:  # flat groups (both right, both wrong): skipped
            assert bool((p == 0).all())
    torch.testing.assert_close(r["no_skip"], r["full"], rtol=0, atol=0)
