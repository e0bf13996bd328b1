"""The RL algorithm variants of ``ppo.*`` (docs/algorithms.md), each against a reference written here from its
paper's formula on hand-made tensors: Dr. GRPO, DAPO (clip-higher, token-level loss, overlong reward shaping,
dynamic sampling), GSPO, RLOO, REINFORCE++, the train-inference mismatch corrections TIS/MIS, the KL estimators,
and the KL penalty of critic-free runs. The last test runs the actor's training step through the real interface
(output head on the loss rows, micro-batches, vocabulary shards of tensor parallelism) against the formula."""
import math

import pytest
import torch

from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model
from realhf.impl.model.utils import ppo_functional as F

from support.ppo_samples import grpo_sample


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def close(a, b, tol=1e-9):
    assert abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b))), (float(a), float(b))


# ------------------------------------------------------------------------------------------ advantages


def test_grpo_rloo_and_dr_grpo_advantages_against_the_papers():
    r = t(1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 3.0, -1.0, 2.0, 0.0)  # 3 prompts x 4 answers; the second flat
    k = 4
    for g in range(3):
        grp = [float(x) for x in r[g * k : (g + 1) * k]]
        mean = sum(grp) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (k - 1))
        for i, x in enumerate(grp):
            j = g * k + i
            loo = x - sum(y for m, y in enumerate(grp) if m != i) / (k - 1)  # Ahmadian et al.: r_i - mean of the rest
            close(F.rloo_advantages(r, k)[j], loo)
            close(F.group_normalized_advantages(r, k, std_norm=False)[j], x - mean)  # Dr. GRPO: no std division
            close(F.group_normalized_advantages(r, k)[j], 0.0 if std == 0 else (x - mean) / (std + 1e-6))
    assert F.rloo_advantages(r, k)[4:8].abs().max() == 0  # a flat group has no signal
    with pytest.raises(ValueError, match="group_size >= 2"):
        F.rloo_advantages(r, 1)


def _packed():
    """Three answers of unequal lengths (5, 3, 6 positions) whose loss masks leave out prompt positions and, in the
    third, two inserted positions (a multi-turn answer)."""
    cu = torch.tensor([0, 5, 8, 14])
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    return cu, mask


def test_reinforce_pp_returns_are_discounted_sums_of_the_token_rewards():
    cu, mask = _packed()
    r = torch.linspace(-1.0, 2.0, 14, dtype=torch.float64)
    for gamma in (1.0, 0.9):
        got = F.reinforce_returns(r, cu, mask, gamma)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            pos = [p for p in range(a, b) if mask[p]]
            for n, p in enumerate(pos):  # G_t = sum_{s >= t} gamma^(s - t) r_s over the answer's tokens
                close(got[p], sum(gamma ** (m - n) * float(r[q]) for m, q in enumerate(pos) if m >= n))
        assert got[~mask].abs().max() == 0


def test_overlong_penalty_is_dapos_soft_punishment():
    L_max, L_cache = 20, 4
    lens = torch.arange(0, 23)
    got = F.overlong_penalty(lens, L_max, L_cache, factor=0.5)
    for y, p in zip(lens.tolist(), got.tolist()):  # Yu et al. 2025, eq. 13, scaled by the factor
        want = 0.0 if y <= L_max - L_cache else ((L_max - L_cache) - y) / L_cache if y <= L_max else -1.0
        close(p, 0.5 * want, 1e-6)


# ------------------------------------------------------------------------------------------ losses


def test_loss_aggregation_token_answer_and_constant_and_micro_batch_weights():
    cu, mask = _packed()
    sid = F.seq_ids(cu, 14, "cpu")[0]
    lt = torch.linspace(0.5, 3.0, 14, dtype=torch.float64)
    per = [[float(lt[p]) for p in range(a, b) if mask[p]] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    close(F.aggregate_loss(lt, mask, "token-mean"), sum(map(sum, per)) / sum(map(len, per)))  # DAPO
    close(F.aggregate_loss(lt, mask, "seq-mean-token-mean", sid), sum(sum(x) / len(x) for x in per) / 3)  # GRPO
    close(F.aggregate_loss(lt, mask, "seq-mean-token-sum-norm", sid, 8.0), sum(map(sum, per)) / (3 * 8.0))  # Dr. GRPO
    # an answer without a masked token does not count as an answer
    m2 = mask.clone()
    m2[5:8] = False
    close(F.aggregate_loss(lt, m2, "seq-mean-token-mean", sid), (sum(per[0]) / 4 + sum(per[2]) / 4) / 2)
    # micro-batches weighted by loss_weight give the whole batch's loss: answer 0 | answers 1, 2
    for mode in F.LOSS_AGG_MODES:
        parts = [slice(0, 5), slice(5, 14)]
        w = [F.loss_weight(mask[p], mode, sid[p]) for p in parts]
        mixed = sum(F.aggregate_loss(lt[p], mask[p], mode, sid[p], 8.0) * wi for p, wi in zip(parts, w)) / sum(w)
        close(mixed, F.aggregate_loss(lt, mask, mode, sid, 8.0))


def test_clip_higher_raises_only_the_upper_bound():
    # ratios 1.25 (A > 0) and 0.75 (A < 0); eps_clip 0.2, eps_clip_higher 0.28 (DAPO)
    logp, old = torch.log(t(1.25, 0.75)), t(0.0, 0.0)
    adv, mask = t(1.0, -1.0), torch.tensor([True, True])
    sym, st = F.actor_loss(logp, old, adv, 0.2, mask)
    close(sym, (-1.2 + 0.8) / 2)  # both clipped at 1 +- 0.2
    close(st["clip_ratio"], 1.0)
    hi, st = F.actor_loss(logp, old, adv, 0.2, mask, eps_clip_higher=0.28)
    close(hi, (-1.25 + 0.8) / 2)  # 1.25 < 1.28: the positive token is no longer clipped; the lower bound stays
    close(st["clip_ratio"], 0.5)


def test_gspo_loss_is_the_sequence_level_objective():
    """Value and gradient equal Zheng et al.'s objective written per answer: s_i = exp(mean_t log ratio),
    l_i = max(-A_i s_i, -A_i clip(s_i)), loss = mean_i l_i."""
    cu, mask = _packed()
    sid = F.seq_ids(cu, 14, "cpu")[0]
    g = torch.Generator().manual_seed(0)
    old = -2.0 - torch.rand(14, generator=g, dtype=torch.float64)
    base_lp = old + 0.3 * torch.randn(14, generator=g, dtype=torch.float64)
    seq_adv = t(1.0, -2.0, 0.5)
    adv = seq_adv[sid]
    lo, hi = 1 - 0.05, 1 + 0.08

    def reference(lp):
        total = 0.0
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            m = mask[a:b]
            s = torch.exp((lp[a:b] - old[a:b])[m].mean())
            total = total + torch.maximum(-seq_adv[i] * s, -seq_adv[i] * s.clamp(lo, hi))
        return total / 3

    lp1 = base_lp.clone().requires_grad_()
    loss, st = F.gspo_loss(lp1, old, adv, 0.05, mask, sid, eps_clip_higher=0.08)
    loss.backward()
    lp2 = base_lp.clone().requires_grad_()
    want = reference(lp2)
    want.backward()
    close(loss.detach(), want.detach())
    torch.testing.assert_close(lp1.grad, lp2.grad)
    assert lp1.grad[mask].abs().max() > 0 and lp1.grad[~mask].abs().max() == 0
    # the clip decision is per answer: every token of an answer is clipped, or none
    clipped_answers = {int(sid[p]) for p in range(14) if mask[p]} if float(st["clip_ratio"]) == 1.0 else None
    assert clipped_answers is None or len(clipped_answers) == 3


def test_tis_truncates_and_mis_masks_the_behaviour_weight():
    """Yao et al. 2025: weight rho = pi_trainer / pi_generator; TIS uses min(rho, C), MIS rho * 1[rho <= C] (the
    tokens above C leave the loss). PPO's ratio is taken against the trainer's log-probs."""
    gen_lp = torch.log(t(0.2, 0.5, 0.5))  # the generator's (behaviour) log-probs
    trainer = torch.log(t(0.5, 0.5, 0.4))  # the trainer's (proximal): rho = 2.5, 1.0, 0.8
    logp = torch.log(t(0.55, 0.5, 0.4))  # the policy being trained: ratios 1.1, 1.0, 1.0
    adv, mask, C = t(1.0, -1.0, 2.0), torch.tensor([True, True, True]), 2.0
    rho = torch.exp(trainer - gen_lp)
    per_tok = -adv * torch.exp(logp - trainer)  # no clipping at eps 0.2
    loss, st = F.actor_loss(logp, gen_lp, adv, 0.2, mask, proximal_logprobs=trainer, behav_imp_weight_cap=C,
                            behav_imp_weight_mode="truncate")
    close(loss, (torch.minimum(rho, torch.tensor(C, dtype=torch.float64)) * per_tok).mean())
    close(st["behave_capped_ratio"], 1 / 3, 1e-6)  # stats are float32
    close(st["behave_logp_abs_diff"], (trainer - gen_lp).abs().mean(), 1e-6)
    loss, st = F.actor_loss(logp, gen_lp, adv, 0.2, mask, proximal_logprobs=trainer, behav_imp_weight_cap=C,
                            behav_imp_weight_mode="mask")
    close(loss, (rho[1:] * per_tok[1:]).mean())  # the first token (rho 2.5 > C) leaves the loss
    close(st["behave_capped_ratio"], 1 / 3, 1e-6)


def test_kl_estimators_of_the_reward_penalty():
    logp, ref = t(-1.0, -2.0, -0.5), t(-1.5, -1.0, -0.5)
    cu, mask = torch.tensor([0, 3]), torch.tensor([True, True, True])
    d = logp - ref
    for name, want in (("k1", d), ("k2", 0.5 * d * d), ("k3", torch.exp(-d) + d - 1)):  # Schulman 2020
        tok, kl = F.kl_reward_shaping(t(1.0), logp, ref, 0.1, cu, mask, estimator=name)
        torch.testing.assert_close(kl, -0.1 * want)
        close(tok[2], 1.0 - 0.1 * float(want[2]))
    with pytest.raises(ValueError, match="k4"):
        F.kl_reward_shaping(t(1.0), logp, ref, 0.1, cu, mask, estimator="k4")


# ------------------------------------------------------------------------------------------ advantages of a step


def _cfg(**kw):
    from realhf.api.quickstart.ppo_config import PPOHyperparameters, SamplingConfig

    return PPOHyperparameters(**{"adv_norm": False, "gen": SamplingConfig(max_new_tokens=6), **kw})


def _with_ref(sample, shift: float):
    """``sample`` with reference log-probs ``shift`` below the behaviour's, on answer positions only."""
    from realhf.impl.model.interface.ppo_interface import _per_token, answer_loss_mask

    m = answer_loss_mask(sample)
    ref = torch.where(m, sample.data["packed_logprobs"] - shift * torch.arange(m.numel()) / m.numel(),
                      torch.zeros(m.numel()))
    return _per_token(sample, {"packed_ref_logprobs": ref})


def _per_answer(sample, x, mask):
    cu = sample.cu_seqlens("packed_input_ids").tolist()
    return [x[a:b][mask[a:b]] for a, b in zip(cu[:-1], cu[1:])]


def test_kl_penalty_of_critic_free_runs_lowers_each_answers_reward_both_ways():
    """use_critic=false with kl_ctl > 0: each answer's reward loses kl_ctl times its summed KL (k1) before the group
    baseline; with kl_ctl = 0 the raw rewards make the advantages."""
    from realhf.impl.model.interface.ppo_interface import compute_advantages

    rewards = [5.0, -5.0, 5.0, 5.0, 5.0, 5.0]
    s = _with_ref(grpo_sample(100, rewards, 3), shift=1.0)
    beh, ref = s.data["packed_logprobs"], s.data["packed_ref_logprobs"]
    mask, adv, _, st = compute_advantages(s, _cfg(kl_ctl=0.5), None, use_critic=False, group_size=3)
    kl_sum = [float(k.sum()) for k in _per_answer(s, beh - ref, mask)]
    score = torch.tensor([r - 0.5 * k for r, k in zip(rewards, kl_sum)], dtype=torch.float64)
    want = [score[i] - score[(i // 3) * 3 : (i // 3) * 3 + 3].mean() for i in range(6)]  # group mean baseline
    for a, w in zip(_per_answer(s, adv, mask), want):
        torch.testing.assert_close(a.double(), torch.full_like(a.double(), float(w)), atol=1e-5, rtol=1e-5)
    assert st["kl_reward"] < 0
    # the second prompt's rewards are all equal, but the KL penalty separates its answers
    assert any(float(a.abs().max()) > 0 for a in _per_answer(s, adv, mask)[3:])
    _, adv0, _, st0 = compute_advantages(s, _cfg(kl_ctl=0.0), None, use_critic=False, group_size=3)
    for a, r, i in zip(_per_answer(s, adv0, mask), rewards, range(6)):
        g = rewards[(i // 3) * 3 : (i // 3) * 3 + 3]
        torch.testing.assert_close(a, torch.full_like(a, r - sum(g) / 3))
    assert st0["kl_reward"] == 0


def test_reinforce_pp_and_overlong_shaping_through_the_advantages():
    """REINFORCE++: per token the return of the KL-shaped reward (task reward at the last answer token), whitened over
    the batch; DAPO's overlong penalty lowers the rewards of long answers first."""
    from realhf.impl.model.interface.ppo_interface import answer_lengths, compute_advantages

    rewards = [5.0, -5.0, 5.0, 5.0]
    s = _with_ref(grpo_sample(100, rewards, 2), shift=1.0)
    cfg = _cfg(adv_estimator="reinforce++", kl_ctl=0.1, adv_norm=True, overlong_tokens=2, overlong_penalty_factor=1.5)
    mask, adv, _, st = compute_advantages(s, cfg, None, use_critic=False, group_size=2)
    lens = answer_lengths(s).tolist()  # 3..6 answer tokens, max_new_tokens=6: buffer from 4 tokens on
    shaped = [r - 1.5 * min(1.0, max(0.0, (y - 4) / 2)) for r, y in zip(rewards, lens)]
    kl = _per_answer(s, -0.1 * (s.data["packed_logprobs"] - s.data["packed_ref_logprobs"]), mask)
    returns = []
    for r, k in zip(shaped, kl):
        tok = k.double().clone()
        tok[-1] += r
        returns.append(torch.flip(torch.cumsum(torch.flip(tok, [0]), 0), [0]))
    allr = torch.cat(returns)
    want = (allr - allr.mean()) / torch.sqrt(allr.var(unbiased=False) + 1e-5)
    torch.testing.assert_close(torch.cat(_per_answer(s, adv, mask)).double(), want, atol=1e-5, rtol=1e-5)
    close(st["overlong_penalty"], sum(a - b for a, b in zip(shaped, rewards)) / 4, 1e-6)
    assert st["overlong_penalty"] < 0


# ------------------------------------------------------------------------------------------ dynamic sampling


def test_dynamic_sampling_refills_the_batch_and_fills_up_after_the_last_round():
    from realhf.system.trainer.dynamic_sampling import fill_batch

    # batches of 4 prompts (2 answers each); "f" prompts got one reward for both answers
    batches = [["a", "f1", "b", "f2"], ["f3", "c", "f4", "f5"], ["d", "e", "f6", "g"]]
    vals = {i: ([1.0, 1.0] if i.startswith("f") else [1.0, -1.0]) for b in batches for i in b}
    ran, fetched = [], iter(batches)

    def fetch():
        ids = next(fetched)
        return ids, {"epoch": 0, "is_epoch_last": ids[0] == "f3"}

    got = fill_batch(fetch, lambda ids: ran.append(list(ids)) or {"actor_gen": {"time": 1.0}},
                     lambda ids: {i: vals[i] for i in ids}, max_rounds=5)
    assert got.kept == ["a", "b", "c", "d"] and ran == batches  # the third round filled it; "e", "g" are extra
    assert got.all_ids == sum(batches, []) and got.info["is_epoch_last"]
    assert got.mfc_stats["actor_gen"]["time"] == 3.0
    assert got.stats["dynamic_sampling/rounds"] == 3 and got.stats["dynamic_sampling/filled"] == 0
    close(got.stats["dynamic_sampling/signal_frac"], 6 / 12)
    close(got.stats["dynamic_sampling/all_mean"], 12 / 24)  # 6 prompts answered (1, -1), 6 (1, 1)
    # at most two rounds: three prompts with signal, the fourth place filled with a dropped prompt
    fetched = iter(batches)
    got = fill_batch(fetch, lambda ids: {}, lambda ids: {i: vals[i] for i in ids}, max_rounds=2)
    assert got.kept == ["a", "b", "c", "f1"] and got.stats["dynamic_sampling/filled"] == 1


# ------------------------------------------------------------------------------------------ options


def test_algorithm_options_name_the_functions_and_refuse_what_does_not_fit():
    from realhf.api.quickstart import ppo_config as pc

    assert set(pc.POLICY_LOSSES) == set(F.POLICY_LOSSES)
    assert set(pc.KL_ESTIMATORS) == set(F.KL_ESTIMATORS)
    assert set(pc.LOSS_AGG_MODES) == set(F.LOSS_AGG_MODES)
    assert pc.PPOHyperparameters().loss_aggregation() == "token-mean"
    assert pc.PPOHyperparameters(policy_loss="gspo").loss_aggregation() == "seq-mean-token-mean"
    assert pc.PPOHyperparameters(mismatch_correction="tis", mismatch_cap=3.0).behaviour_weight() == (3.0, "truncate")
    for kw, key in ((dict(adv_estimator="ppo"), "adv_estimator"), (dict(loss_agg_mode="seq-sum"), "loss_agg_mode"),
                    (dict(eps_clip_higher=-0.1), "eps_clip_higher"), (dict(kl_loss_estimator="k5"), "kl_loss_estimator"),
                    (dict(overlong_tokens=300), "overlong_tokens"), (dict(mismatch_cap=1.0), "mismatch_cap"),
                    (dict(mismatch_correction="mis", behav_imp_weight_cap=2.0), "behav_imp_weight_cap"),
                    (dict(policy_loss="gspo", c_clip=3.0), "c_clip")):
        with pytest.raises(ValueError, match=key):
            pc.PPOHyperparameters(**kw)


@pytest.mark.parametrize("items,key", [(["use_critic=true", "ppo.adv_estimator=rloo"], "ppo.adv_estimator"),
                                       (["use_critic=false", "ppo.adv_estimator=rloo"], "group_size"),
                                       (["use_critic=false", "ppo.dynamic_sampling=true"], "group_size")])
def test_experiment_refuses_options_that_need_other_sections(tmp_path, items, key):
    from realhf.api.quickstart.config import PPOMathConfig
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    write_math_jsonl(make_arithmetic_problems(8, seed=1, kind="add"), str(tmp_path / "m.jsonl"))
    cfg = load_config(PPOMathConfig, [], [f"actor.path={ensure_tiny_model('qwen2')}", f"dataset.path={tmp_path}/m.jsonl",
                                          f"fileroot={tmp_path}", *items])
    with pytest.raises(ValueError, match=key):
        build_spec("ppo-math", cfg)


# ------------------------------------------------------------------------------------------ the real training step

LR = 1e-2


def _variant(name):
    from realhf.api.quickstart.ppo_config import PPOHyperparameters, SamplingConfig

    common = dict(ppo_n_minibatches=1, kl_ctl=0.0, adv_norm=False, gen=SamplingConfig(temperature=0.9,
                                                                                       max_new_tokens=8))
    if name == "gspo":  # GSPO with a k2 KL loss and an entropy bonus, per-answer aggregation
        return PPOHyperparameters(policy_loss="gspo", eps_clip=0.05, eps_clip_higher=0.08, kl_loss_coef=0.1,
                                  kl_loss_estimator="k2", entropy_coef=0.01, group_adv_norm=True, **common)
    # Dr. GRPO's loss (token sums over a constant) with clip-higher
    return PPOHyperparameters(loss_agg_mode="seq-mean-token-sum-norm", eps_clip=0.05, eps_clip_higher=0.1,
                              kl_loss_coef=0.1, **common)


def _reference_loss(name, cfg, lp, ent, mb, tp):
    """The whole batch's loss from the papers' formulas, every position's log-probs (the head on all rows)."""
    cu = mb.cu_seqlens("packed_input_ids").tolist()
    m = mb.data["loss_mask"]
    old, adv, ref = mb.data["packed_logprobs"], mb.data["advantages"], mb.data["packed_ref_logprobs"]
    lo, hi = 1 - cfg.eps_clip, 1 + cfg.eps_clip_higher
    terms = []
    for a, b in zip(cu[:-1], cu[1:]):
        k = m[a:b]
        if not bool(k.any()):
            continue
        A = adv[a:b][k]
        if name == "gspo":  # Zheng et al.: one ratio per answer; k2 KL and entropy as answer means
            s = torch.exp((lp[a:b][k] - old[a:b][k]).mean())
            pg = torch.maximum(-A[0] * s, -A[0] * s.clamp(lo, hi))
            kl = (0.5 * (lp[a:b][k] - ref[a:b][k]) ** 2).mean()
            terms.append(pg + cfg.kl_loss_coef * kl - cfg.entropy_coef * ent[a:b][k].mean())
        else:  # Liu et al.: token sums over the constant max_new_tokens, k3 KL alike
            r = torch.exp(lp[a:b][k] - old[a:b][k])
            pg = torch.maximum(-A * r, -A * r.clamp(lo, hi)).sum()
            kl = F.kl_k3(lp[a:b][k], ref[a:b][k]).sum()
            terms.append((pg + cfg.kl_loss_coef * kl) / cfg.gen.max_new_tokens)
    return sum(terms) / len(terms)


def _step_worker(path, layout):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface, _per_token, compute_advantages
    from realhf.impl.model.utils.functional import packed_entropy, packed_logprobs

    grid = ParallelGrid(ParallelDims(*layout))
    res = {}
    for name in ("gspo", "drgrpo"):
        cfg = _variant(name)
        iface = PPOActorInterface(cfg, group_size=2, use_critic=False, seed=1)
        m = build_from_hf(path, grid=grid)
        model = Model(name="actor", engine=TrainEngine(m, OptimizerConfig(lr=LR), 10), tokenizer=None, grid=grid,
                      path="")
        sample = grpo_sample(m.config.vocab_size, [5.0, -5.0, -5.0, 5.0, 5.0, 1.0], 2, seed=4)
        # behaviour log-probs near the model's own, so that some ratios fall inside the clip range and some outside
        own = iface.inference(model, sample, MicroBatchSpec())
        lp0 = own.data["logprobs"]
        g = torch.Generator().manual_seed(5)
        beh = torch.where(lp0 != 0, lp0 + 0.1 * torch.randn(lp0.numel(), generator=g), torch.zeros_like(lp0))
        sample = _per_token(sample, {"packed_logprobs": beh, "packed_ref_logprobs": beh - 0.2})
        iface.train_step(model, sample, MicroBatchSpec(max_tokens_per_mb=20))  # head rows, several micro-batches
        ref_m = build_from_hf(path, grid=grid)
        ref_engine = TrainEngine(ref_m, OptimizerConfig(lr=LR), 10)
        mask, adv, _, _ = compute_advantages(sample, cfg, grid, use_critic=False, group_size=2)
        s = _per_token(sample, {"advantages": adv.float(), "loss_mask": mask})

        def loss_fn(out, mb):
            lp, _ = packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids"), m.tp_group,
                                    0.9)
            ent = packed_entropy(out.float() / 0.9, m.tp_group)
            return _reference_loss(name, cfg, lp, ent, mb, m.tp_group), {}

        ref_engine.train_batch(s, loss_fn, lambda mb: 1.0)  # one micro-batch: the whole batch
        # the gradients of the two (Adam's first step moves every parameter by about lr: it would hide their size)
        res[name] = (m.flat_grad.detach().clone(), ref_m.flat_grad.detach().clone())
    return res


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1)], ids=["d1m1p1", "d1m2p1"])
def test_training_step_of_gspo_and_dr_grpo_equals_the_formula(layout):
    """The interface's step (head on loss rows, several micro-batches; with m2 the log-probs and the entropy over two
    vocabulary shards) has the gradient of the papers' loss over the whole batch in one micro-batch."""
    path = ensure_tiny_model("qwen2")
    for r in run_distributed(_step_worker, layout[1], path, layout):
        for name, (got, want) in r.items():
            scale = float(want.abs().max())
            assert scale > 1e-3, name
            torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-4, msg=name)
