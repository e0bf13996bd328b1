"""PPO/GRPO functional pieces against values computed by hand on tiny tensors."""
import math

import pytest
import torch

from realhf.testing import run_distributed
from realhf.impl.model.utils import ppo_functional as F


def t(*xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def b(*xs):
    return torch.tensor(xs, dtype=torch.bool)


def close(x, expected, tol=1e-9):
    x = x.item() if isinstance(x, torch.Tensor) else x
    assert abs(x - expected) <= tol, f"{x} != {expected}"


# ------------------------------------------------------------------------------- actor loss


def test_actor_loss_clipping():
    # old_logprobs = 0, so ratio r = exp(logprobs); eps = 0.2 -> clip range [0.8, 1.2]
    # tok0: r=1.5, A= 1: l1=-1.5, l2=-1.2 -> max -1.2  (clipped)
    # tok1: r=0.5, A=-1: l1= 0.5, l2= 0.8 -> max  0.8  (clipped)
    # tok2: r=1.0, A= 2: l1=-2.0, l2=-2.0 -> -2.0
    # tok3: r=1.1, A=-2: l1= 2.2, l2= 2.2 ->  2.2
    # tok4: masked out (r=3, A=5)
    # loss = (-1.2 + 0.8 - 2.0 + 2.2) / 4 = -0.05 ; clip_ratio = 2/4 ; importance_weight = 4.1/4
    # approx_kl = mean(old - new) = -(log 1.5 + log 0.5 + log 1 + log 1.1) / 4
    logp = torch.log(t(1.5, 0.5, 1.0, 1.1, 3.0)).requires_grad_()
    old = torch.zeros(5, dtype=torch.float64)
    adv = t(1.0, -1.0, 2.0, -2.0, 5.0)
    mask = b(True, True, True, True, False)
    loss, st = F.actor_loss(logp, old, adv, 0.2, mask)
    close(loss, -0.05)
    close(st["loss"], -0.05, 1e-6)
    close(st["clip_ratio"], 0.5, 1e-6)
    close(st["dual_clip_ratio"], 0.0)
    close(st["importance_weight"], 1.025, 1e-6)
    close(st["approx_kl"], -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 4, 1e-6)
    close(st["behave_imp_weight"], 1.0, 1e-6)
    # d loss / d logp_t = -A_t * r_t / 4 on unclipped masked tokens, 0 on clipped and masked-out ones
    loss.backward()
    torch.testing.assert_close(logp.grad, t(0.0, 0.0, -2.0 * 1.0 / 4, 2.0 * 1.1 / 4, 0.0))


def test_actor_loss_dual_clip():
    # eps = 0.2, c_clip = 3, all tokens masked, old = 0
    # tok0: r=4.0, A=-1: l1=4.0, l2=1.2 -> max 4.0; dual cap -c*A = 3 < 4 -> 3.0 (dual clip active)
    # tok1: r=1.1, A=-1: l1=1.1, l2=1.1 -> 1.1 (cap 3 not active)
    # tok2: r=0.5, A= 1: l1=-0.5, l2=-0.8 -> -0.5 (A > 0: dual clip never applies)
    # loss = (3 + 1.1 - 0.5)/3 = 1.2 ; without dual clip (4 + 1.1 - 0.5)/3 = 4.6/3
    logp = torch.log(t(4.0, 1.1, 0.5))
    old = torch.zeros(3, dtype=torch.float64)
    adv = t(-1.0, -1.0, 1.0)
    mask = b(True, True, True)
    loss, st = F.actor_loss(logp, old, adv, 0.2, mask, c_clip=3.0)
    close(loss, 1.2)
    close(st["dual_clip_ratio"], 1 / 3, 1e-6)
    close(st["clip_ratio"], 0.0)
    loss_nodual, st2 = F.actor_loss(logp, old, adv, 0.2, mask)
    close(loss_nodual, 4.6 / 3)
    close(st2["dual_clip_ratio"], 0.0)
    with pytest.raises(AssertionError, match="c_clip"):
        F.actor_loss(logp, old, adv, 0.2, mask, c_clip=0.5)


def test_actor_loss_proximal_policy():
    # behaviour (old) r_old = exp(log 1.1 - log 0.5) = 2.2 -> clipped to 1.2, A=1 -> loss -1.2
    # decoupled: ratio vs proximal = 1.1 (inside the clip range), behaviour weight exp(0 - log 0.5) = 2
    #            loss = 2 * -(1 * 1.1) = -2.2
    logp, old, prox = torch.log(t(1.1)), torch.log(t(0.5)), t(0.0)
    adv, mask = t(1.0), b(True)
    loss, _ = F.actor_loss(logp, old, adv, 0.2, mask)
    close(loss, -1.2)
    loss, st = F.actor_loss(logp, old, adv, 0.2, mask, proximal_logprobs=prox)
    close(loss, -2.2)
    close(st["behave_imp_weight"], 2.0, 1e-6)
    close(st["importance_weight"], 1.1, 1e-6)


def test_actor_loss_behaviour_weight_cap_drops_far_off_policy_tokens():
    # two tokens: behaviour weights exp(0 - log 0.5) = 2 and exp(0 - 0) = 1; A = 1, ratio vs proximal 1.1
    logp, old, prox = torch.log(t(1.1, 1.1)), torch.log(t(0.5, 1.0)), t(0.0, 0.0)
    adv, mask = t(1.0, 1.0), b(True, True)
    loss, st = F.actor_loss(logp, old, adv, 0.2, mask, proximal_logprobs=prox)
    close(loss, -(2 * 1.1 + 1 * 1.1) / 2)
    close(st["behave_capped_ratio"], 0.0)
    # a cap of 1.5 drops the first token: the mean is over the second alone
    loss, st = F.actor_loss(logp, old, adv, 0.2, mask, proximal_logprobs=prox, behav_imp_weight_cap=1.5)
    close(loss, -1.1)
    close(st["behave_capped_ratio"], 0.5)
    # the gradient reaches only the kept token
    lp = torch.log(t(1.1, 1.1)).requires_grad_()
    F.actor_loss(lp, old, adv, 0.2, mask, proximal_logprobs=prox, behav_imp_weight_cap=1.5)[0].backward()
    assert lp.grad[0] == 0 and lp.grad[1] != 0


def test_actor_loss_empty_mask_is_zero_not_nan():
    loss, st = F.actor_loss(t(0.3, 0.1), t(0.0, 0.0), t(1.0, 1.0), 0.2, b(False, False))
    close(loss, 0.0)
    close(st["clip_ratio"], 0.0)


# ------------------------------------------------------------------------------- critic loss


def test_critic_loss_mse_and_huber():
    # eps = 0.5; mask excludes tok3
    # tok0: v=1, old=1, R=2: v_clip=1   -> 0.5*1^2 = 0.5 both                   -> 0.5
    # tok1: v=2, old=1, R=0: v_clip=1.5 -> orig 0.5*4=2, clip 0.5*2.25=1.125   -> 2.0
    # tok2: v=1, old=0, R=2: v_clip=0.5 -> orig 0.5*1=0.5, clip 0.5*2.25=1.125 -> 1.125 (clip active)
    # loss = (0.5 + 2 + 1.125)/3 = 3.625/3 ; value_clip_ratio = 1/3 ; unclipped loss = 3/3 = 1
    v = t(1.0, 2.0, 1.0, 5.0)
    old = t(1.0, 1.0, 0.0, 0.0)
    ret = t(2.0, 0.0, 2.0, 9.0)
    mask = b(True, True, True, False)
    loss, st = F.critic_loss(v, old, ret, 0.5, mask)
    close(loss, 3.625 / 3)
    close(st["value_clip_ratio"], 1 / 3, 1e-6)
    loss, st = F.critic_loss(v, old, ret, None, mask)
    close(loss, 1.0)
    close(st["value_clip_ratio"], 0.0)
    # huber (delta 1): f(e) = 0.5 e^2 if |e|<=1 else |e| - 0.5
    # tok0: e=-1 -> 0.5 ; tok1: orig e=2 -> 1.5, clip e=1.5 -> 1.0 -> 1.5 ; tok2: orig e=-1 -> 0.5, clip e=-1.5 -> 1.0
    # loss = (0.5 + 1.5 + 1.0)/3 = 1.0
    loss, _ = F.critic_loss(v, old, ret, 0.5, mask, loss_fn_type="huber")
    close(loss, 1.0)
    with pytest.raises(ValueError, match="loss_fn_type"):
        F.critic_loss(v, old, ret, 0.5, mask, loss_fn_type="l3")


def test_critic_loss_gradient_zero_when_clipped():
    v = t(1.0, 2.0).requires_grad_()
    # tok0: clip active (see above: v=1, old=0, R=2) -> grad 0; tok1: v=2, old=2, R=0 -> d/dv 0.5(v-R)^2 / 2 = 1
    loss, _ = F.critic_loss(v, t(0.0, 2.0), t(2.0, 0.0), 0.5, b(True, True))
    loss.backward()
    torch.testing.assert_close(v.grad, t(0.0, 1.0))


def test_entropy_bonus():
    close(F.entropy_bonus(t(0.5, 1.0, 2.0), b(True, False, True)), 1.25)


# ------------------------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    # k1 = logp - ref = [0.5, -1] ; k2 = 0.5 * k1^2 = [0.125, 0.5]
    # k3: d = ref - logp = [-0.5, 1]; exp(d) - d - 1 = [e^-0.5 - 0.5, e - 2]
    torch.testing.assert_close(F.kl_k1(logp, ref), t(0.5, -1.0))
    torch.testing.assert_close(F.kl_k2(logp, ref), t(0.125, 0.5))
    torch.testing.assert_close(F.kl_k3(logp, ref), t(math.exp(-0.5) - 0.5, math.e - 2.0))
    assert (F.kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_kl_reward_shaping():
    # 3 sequences with per-token lengths 3, 2, 1 ; the last one has no answer token
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    mask = b(False, True, True, True, False, False)
    logp = t(0.0, -1.0, -2.0, -1.0, -3.0, -1.0)
    ref = t(0.0, -1.5, -1.0, -1.0, -1.0, -2.0)
    # kl_rewards = -0.1 * (logp - ref) on the mask = [0, -0.05, 0.1, 0, 0, 0]
    # task rewards [5, -0.5, 3] clipped to +-1 -> [1, -0.5, 1]; placed at the last masked token: idx 2 and 3
    tok, kl = F.kl_reward_shaping(t(5.0, -0.5, 3.0), logp, ref, 0.1, cu, mask, max_reward_clip=1.0)
    torch.testing.assert_close(kl, t(0.0, -0.05, 0.1, 0.0, 0.0, 0.0))
    torch.testing.assert_close(tok, t(0.0, -0.05, 1.1, -0.5, 0.0, 0.0))
    tok, _ = F.kl_reward_shaping(t(5.0, -0.5, 3.0), logp, ref, 0.1, cu, mask, max_reward_clip=None)
    torch.testing.assert_close(tok, t(0.0, -0.05, 5.1, -0.5, 0.0, 0.0))


def test_kl_controllers():
    fixed = F.FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    ctl = F.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # kl 9: e = clip(9/6 - 1 = 0.5) = 0.2 ; value = 0.1 * (1 + 0.2 * 100 / 10000) = 0.1002
    ctl.update(9.0, 100)
    close(ctl.value, 0.1002, 1e-12)
    # kl 3: e = clip(-0.5) = -0.2 ; value = 0.1002 * (1 - 0.002) = 0.0999996
    ctl.update(3.0, 100)
    close(ctl.value, 0.0999996, 1e-12)
    # kl 6.6: e = 0.1 ; value *= 1 + 0.1 * 1000 / 10000 = 1.01
    ctl.update(6.6, 1000)
    close(ctl.value, 0.0999996 * 1.01, 1e-12)


# ------------------------------------------------------------------------------- GRPO, masks


def test_group_normalized_advantages():
    r = t(1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 0.0, 0.0, 3.0)
    # group [1,2,3]: mean 2, unbiased std 1 -> [-1, 0, 1]/(1+eps)
    # group [4,4,4]: all equal -> 0
    # group [0,0,3]: mean 1, deviations [-1,-1,2], unbiased var (1+1+4)/2 = 3 -> [-1,-1,2]/(sqrt 3 + eps)
    eps = 1e-6
    s3 = math.sqrt(3)
    expected = t(-1 / (1 + eps), 0.0, 1 / (1 + eps), 0.0, 0.0, 0.0, -1 / (s3 + eps), -1 / (s3 + eps), 2 / (s3 + eps))
    torch.testing.assert_close(F.group_normalized_advantages(r, 3, eps=eps), expected)
    torch.testing.assert_close(
        F.group_normalized_advantages(r, 3, std_norm=False), t(-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0, -1.0, 2.0)
    )
    # float32 equal rewards give exact zeros (no 1e-8 noise divided by eps)
    z = F.group_normalized_advantages(torch.full((4,), 0.1, dtype=torch.float32), 2)
    assert z.dtype == torch.float32 and (z == 0).all()
    # group of one -> 0 (no NaN from the unbiased std)
    assert (F.group_normalized_advantages(t(1.0, 5.0), 1) == 0).all()
    with pytest.raises(ValueError, match=r"n_seqs=5.*group_size=3"):
        F.group_normalized_advantages(t(1.0, 2.0, 3.0, 4.0, 5.0), 3)


def test_broadcast_and_length_limit_mask():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    mask = b(False, True, True, True, False)
    torch.testing.assert_close(
        F.broadcast_sequence_advantages(t(1.5, -2.0), cu, mask), t(0.0, 1.5, 1.5, -2.0, 0.0)
    )
    assert F.length_limit_mask(b(False, True), cu, mask).tolist() == [False, True, True, False, False]
    assert F.length_limit_mask(b(True, False), cu, mask).tolist() == [False, False, False, True, False]
    # last masked token per sequence (-1 when a sequence has none)
    assert F.last_masked_index(cu, b(True, True, False, False, False)).tolist() == [1, -1]


# ------------------------------------------------------------------------------- normalisation


def test_masked_normalization_single_process():
    x, mask = t(1.0, 2.0, 3.0, 100.0), b(True, True, True, False)
    # mean 2 ; population var 2/3 -> (x - 2) / sqrt(2/3 + eps) ; masked-out entry -> 0
    eps = 1e-5
    s = math.sqrt(2 / 3 + eps)
    torch.testing.assert_close(F.masked_normalization(x, mask, eps=eps), t(-1 / s, 0.0, 1 / s, 0.0))
    # unbiased var = 1
    s = math.sqrt(1 + eps)
    torch.testing.assert_close(F.masked_normalization(x, mask, eps=eps, unbiased=True), t(-1 / s, 0.0, 1 / s, 0.0))
    y = F.masked_normalization(x.float(), mask)
    assert y.dtype == torch.float32


def _distributed_normalization():
    """Rank 0 holds masked values {1, 2}, rank 1 holds {3, 4, 5}: global mean 3, population var 2."""
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.group.WORLD
    if rank == 0:
        x, mask = t(1.0, 2.0, 9.0), b(True, True, False)
    else:
        x, mask = t(3.0, 4.0, 5.0), b(True, True, True)
    out = F.masked_normalization(x, mask, eps=0.0, all_reduce_group=group)
    vn = F.ValueNormalizer(all_reduce_group=group)
    vn.update(x, mask)
    return out, vn.state_dict()


def test_masked_normalization_across_two_gloo_ranks():
    r0, r1 = run_distributed(_distributed_normalization, 2, timeout=60.0)
    s = math.sqrt(2.0)
    torch.testing.assert_close(r0[0], t(-2 / s, -1 / s, 0.0))
    torch.testing.assert_close(r1[0], t(0.0, 1 / s, 2 / s))
    for st in (r0[1], r1[1]):
        close(st["mean"], 3.0, 1e-12)
        close(st["var"], 2.0, 1e-12)
        close(st["count"], 5.0)


def test_value_normalizer_exact_and_round_trip():
    vn = F.ValueNormalizer()
    # before any update: mean 0, var 1
    close(vn.mean, 0.0)
    vn.update(t(1.0, 2.0, 3.0, 50.0), b(True, True, True, False))
    vn.update(t(4.0, 5.0))
    # all values seen {1..5}: mean 3, population var 2
    close(vn.mean, 3.0, 1e-12)
    close(vn.var, 2.0, 1e-12)
    x = torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(vn.denormalize(vn.normalize(x)), x)
    torch.testing.assert_close(vn.normalize(t(3.0 + math.sqrt(2 + vn.eps))), t(1.0))

    clone = F.ValueNormalizer()
    clone.load_state_dict(vn.state_dict())
    torch.testing.assert_close(clone.normalize(x), vn.normalize(x))
    with pytest.raises(AssertionError, match="missing"):
        clone.load_state_dict({"mean": 0.0})


def test_value_normalizer_ema():
    vn = F.ValueNormalizer(beta=0.9)
    vn.update(t(1.0, 3.0))
    # first update is debiased: exactly the batch statistics (mean 2, var 1)
    close(vn.mean, 2.0, 1e-12)
    close(vn.var, 1.0, 1e-12)
    vn.update(t(10.0, 10.0))
    # ema_mean = 0.9*0.1*2 + 0.1*10 = 1.18 ; debias = 0.19 -> mean = 1.18/0.19
    # ema_sq   = 0.9*0.1*5 + 0.1*100 = 10.45 -> E[x^2] = 10.45/0.19 ; var = E[x^2] - mean^2
    m = 1.18 / 0.19
    close(vn.mean, m, 1e-12)
    close(vn.var, 10.45 / 0.19 - m * m, 1e-9)
    assert F.RunningMeanStd is F.ValueNormalizer
