"""The PPO actor runs its output head only where log-probs are used (``head_rows``): at the loss positions
in training and at the answer positions in log-prob inference. The results must equal the full-position
computation: the same parameters after a training step (with KL loss, entropy bonus, a length-masked
answer and several micro-batches), the same stats, and the same inference log-probs, in layouts with
tensor and pipeline parallelism too."""
import pytest
import torch

from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

PROMPTS = [5, 7, 4]  # prompt lengths; 3 prompts x 2 answers
ANSWERS = [[6, 4], [9, 3], [5, 7]]


def _sample(vocab):
    from realhf.api.core.data_api import SequenceSample

    g = torch.Generator().manual_seed(3)
    ids, lps, pms, refs, seqlens = [], [], [], [], []
    for P, answers in zip(PROMPTS, ANSWERS):
        prompt = torch.randint(3, vocab, (P,), generator=g)
        per = []
        for A in answers:
            ids.append(torch.cat([prompt, torch.randint(3, vocab, (A,), generator=g)]))
            lp = torch.zeros(P + A)
            lp[P - 1 : P + A - 1] = -2.0 - torch.rand(A, generator=g)  # behaviour log-probs on answer positions
            lps.append(lp)
            refs.append(lp + 0.1 * torch.randn(P + A, generator=g))
            pm = torch.zeros(P + A, dtype=torch.bool)
            pm[:P] = True
            pms.append(pm)
            per.append(P + A)
        seqlens.append(per)
    keys = ("packed_input_ids", "packed_logprobs", "prompt_mask", "packed_ref_logprobs")
    data = {"packed_input_ids": torch.cat(ids), "packed_logprobs": torch.cat(lps), "prompt_mask": torch.cat(pms),
            "packed_ref_logprobs": torch.cat(refs),
            # the second answer of the first prompt hit the length limit: mask_too_long drops it from the loss
            "seq_no_eos_mask": torch.tensor([False, True, False, False, False, False]),
            "rewards": torch.tensor([5.0, -5.0, -5.0, 5.0, 5.0, -5.0])}
    return SequenceSample(
        keys=set(data), ids=list(range(len(PROMPTS))),
        seqlens={**{k: seqlens for k in keys}, "seq_no_eos_mask": [[1, 1]] * 3, "rewards": [[1, 1]] * 3},
        trailing_shapes={k: () for k in data}, dtypes={k: v.dtype for k, v in data.items()}, data=data)


TEMPERATURE = 0.9
GROUP_SIZE = 2


def _ppo():
    from realhf.api.quickstart.ppo_config import PPOHyperparameters, SamplingConfig

    return PPOHyperparameters(ppo_n_minibatches=1, kl_ctl=0.0, kl_loss_coef=0.05, entropy_coef=0.01, mask_too_long=True,
                              gen=SamplingConfig(temperature=TEMPERATURE))


def _reference_step(engine, sample, tp):
    """The actor step computed over every position (the head on all tokens, losses masked)."""
    from realhf.impl.model.interface.ppo_interface import _per_token, compute_advantages
    from realhf.impl.model.utils import ppo_functional as F
    from realhf.impl.model.utils.functional import packed_entropy, packed_logprobs

    cfg = _ppo()
    mask, adv, _, _ = compute_advantages(sample, cfg, engine.grid, use_critic=False, group_size=GROUP_SIZE)
    s = _per_token(sample, {"advantages": adv.float(), "loss_mask": mask})

    def loss_fn(out, mb):
        lp, _ = packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids"), tp, TEMPERATURE)
        m = mb.data["loss_mask"]
        loss, st = F.actor_loss(lp, mb.data["packed_logprobs"], mb.data["advantages"], cfg.eps_clip, m)
        loss = loss - cfg.entropy_coef * F.entropy_bonus(packed_entropy(out.float() / TEMPERATURE, tp), m)
        loss = loss + cfg.kl_loss_coef * F.masked_mean(F.kl_k3(lp, mb.data["packed_ref_logprobs"]), m)
        return loss, {"importance_weight": float(st["importance_weight"]) * float(m.sum()), "n": float(m.sum())}

    st = engine.train_batch(s, loss_fn, lambda mb: float(mb.data["loss_mask"].sum()), max_tokens_per_mb=20)
    return st.grad_norm, st.extra["importance_weight"] / st.extra["n"]


def _worker(path, layout):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from realhf.impl.model.utils.functional import packed_logprobs

    grid = ParallelGrid(ParallelDims(*layout))
    res = {}
    iface = PPOActorInterface(_ppo(), group_size=GROUP_SIZE, use_critic=False, seed=1)
    m = build_from_hf(path, grid=grid)
    start = m.flat.detach().clone()
    sample = _sample(m.config.vocab_size)
    # inference: answer positions only, against every position masked to the answer positions
    model = Model(name="actor", engine=TrainEngine(m, OptimizerConfig(lr=1e-2), 10), tokenizer=None, grid=grid, path="")
    out = iface.inference(model, sample, MicroBatchSpec(max_tokens_per_mb=20))
    full = model.engine.forward(sample, max_tokens_per_mb=20, post_fn=lambda o, mb: packed_logprobs(
        o, mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids"), m.tp_group, TEMPERATURE)[0])
    if m.is_last:
        from realhf.impl.model.interface.ppo_interface import answer_loss_mask

        ans = answer_loss_mask(sample)
        res["inf"] = out.data["logprobs"]
        res["inf_full"] = torch.cat(full) * ans
        res["n_answer_positions"] = int(ans.sum())
    # training: the interface's step (head on loss rows) against the reference (head everywhere)
    stats = iface.train_step(model, sample, MicroBatchSpec(max_tokens_per_mb=20))
    ref_m = build_from_hf(path, grid=grid)
    ref_engine = TrainEngine(ref_m, OptimizerConfig(lr=1e-2), 10)
    gn, iw = _reference_step(ref_engine, sample, ref_m.tp_group)
    res.update(grad_norm=stats["actor_grad_norm"], ref_grad_norm=gn, iw=stats["importance_weight"], ref_iw=iw,
               params=m.flat.detach().clone(), ref_params=ref_m.flat.detach().clone(), start=start)
    return res


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["d1m1p1", "d1m2p1", "d1m1p2"])
def test_head_on_used_rows_equals_every_row(layout):
    path = ensure_tiny_model("qwen2")
    world = layout[0] * layout[1] * layout[2]
    for r in run_distributed(_worker, world, path, layout):
        assert abs(r["grad_norm"] - r["ref_grad_norm"]) <= 1e-5 * r["ref_grad_norm"] and r["ref_grad_norm"] > 0
        assert abs(r["iw"] - r["ref_iw"]) < 1e-6
        # the step moved the parameters, and both ways moved them alike
        assert float((r["ref_params"] - r["start"]).abs().max()) > 1e-4
        torch.testing.assert_close(r["params"], r["ref_params"], atol=2e-6, rtol=1e-5)
        if "inf" in r:
            assert r["n_answer_positions"] == sum(map(sum, ANSWERS))
            assert int((r["inf"] != 0).sum()) == r["n_answer_positions"]
            torch.testing.assert_close(r["inf"], r["inf_full"], atol=1e-5, rtol=1e-5)
