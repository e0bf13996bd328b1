"""Non-finite training is stopped, not trained on: a step whose loss or grad norm is NaN/inf is not applied
(parameters and optimizer state unchanged) and counted; past ``optimizer.skip_nonfinite_steps`` such steps the
run stops with :class:`NonFiniteError`, and every rank of a replica decides alike. Non-finite options are
rejected before anything starts."""
import glob
import json
import math
import os
import random

import pytest
import torch

from realhf.testing import run_distributed, run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model

LENS = [7, 3, 12, 5, 9, 4]


@pytest.fixture(scope="module")
def path():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def _batch(vocab, step):
    from realhf.api.core.data_api import SequenceSample

    g = torch.Generator().manual_seed(200 + step)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in LENS]
    return SequenceSample.from_default(ids=list(range(len(LENS))), seqlens=LENS, data={"packed_input_ids": torch.cat(seqs)})


class _InfGrad(torch.autograd.Function):
    """Identity forward (a finite loss), infinite backward (a non-finite grad norm)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def _loss_fn(tp_group, bad: str = ""):
    """The next-token loss; ``bad``: "" (finite), "nan_loss" (NaN loss and grads), "nan_const" (NaN loss,
    finite grads: only the loss tells), "inf_grad" (finite loss, infinite grads)."""
    from realhf.impl.model.utils.functional import packed_logprobs

    def fn(out, mb):
        lp, valid = packed_logprobs(out, mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids"), tp_group)
        loss = -lp.sum() / valid.sum()
        if bad == "nan_loss":
            loss = loss * float("nan")
        elif bad == "nan_const":
            loss = loss + float("nan")
        elif bad == "inf_grad":
            loss = _InfGrad.apply(loss)
        return loss, {"n_tokens": float(valid.sum())}

    return fn


def _weight(mb):
    return float(sum(n - 1 for n in mb.flat_seqlens("packed_input_ids")))


def _engine(path, skip, grid=None):
    from realhf.api.core.config import OptimizerConfig
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf

    model = build_from_hf(path, grid=grid)
    return TrainEngine(model, OptimizerConfig(lr=1e-3, gradient_clipping=1.0, skip_nonfinite_steps=skip), 10)


def _opt_state(eng):
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in eng.optimizer.state_dict()["state"].items()}


def _same_opt_state(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])) for k in a[i])
        for i in a)


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("bad", ["nan_loss", "nan_const", "inf_grad"])
def test_nonfinite_step_is_skipped_then_training_goes_on(path, bad):
    from realhf.impl.model.backend.engine import NonFiniteError

    eng = _engine(path, skip=1)
    vocab = eng.model.config.vocab_size
    st = eng.train_batch(_batch(vocab, 0), _loss_fn(None), _weight)  # a normal step: the optimizer has state
    assert not st.skipped and eng.step_count == 1
    params, opt = eng.model.flat.detach().clone(), _opt_state(eng)
    lr = eng.optimizer.param_groups[0]["lr"]

    st = eng.train_batch(_batch(vocab, 1), _loss_fn(None, bad), _weight)
    assert st.skipped and st.skipped_nonfinite == 1 and eng.skipped_nonfinite == 1
    assert not (math.isfinite(st.loss) and math.isfinite(st.grad_norm)), st
    assert torch.equal(eng.model.flat, params), "a skipped step changed the parameters"
    assert _same_opt_state(_opt_state(eng), opt), "a skipped step changed the optimizer state"
    assert eng.step_count == 1 and eng.optimizer.param_groups[0]["lr"] == lr

    st = eng.train_batch(_batch(vocab, 2), _loss_fn(None), _weight)  # the next finite batch trains normally
    assert not st.skipped and st.skipped_nonfinite == 1 and eng.step_count == 2
    assert math.isfinite(st.loss) and math.isfinite(st.grad_norm)
    assert torch.isfinite(eng.model.flat).all() and not torch.equal(eng.model.flat, params)

    params = eng.model.flat.detach().clone()
    with pytest.raises(NonFiniteError) as ei:  # a second bad step exceeds skip_nonfinite_steps=1
        eng.train_batch(_batch(vocab, 3), _loss_fn(None, bad), _weight)
    msg = str(ei.value)
    for frag in ("optimizer step 2", "loss=", "grad_norm=", "skip_nonfinite_steps=1", "learning rate"):
        assert frag in msg, (frag, msg)
    assert torch.equal(eng.model.flat, params), "the step that stopped the run changed the parameters"


def test_nonfinite_step_stops_at_once_by_default(path):
    from realhf.impl.model.backend.engine import NonFiniteError

    eng = _engine(path, skip=0)
    params = eng.model.flat.detach().clone()
    with pytest.raises(NonFiniteError, match=r"loss=nan.*optimizer step 0.*skip_nonfinite_steps=0"):
        eng.train_batch(_batch(eng.model.config.vocab_size, 0), _loss_fn(None, "nan_loss"), _weight)
    assert torch.equal(eng.model.flat, params) and eng.skipped_nonfinite == 1


def test_state_dict_keeps_the_skip_count(path):
    eng = _engine(path, skip=2)
    vocab = eng.model.config.vocab_size
    eng.train_batch(_batch(vocab, 0), _loss_fn(None), _weight)
    eng.train_batch(_batch(vocab, 1), _loss_fn(None, "nan_loss"), _weight)
    st = eng.state_dict()
    other = _engine(path, skip=2)
    other.model.flat.data.copy_(eng.model.flat)
    other.load_state_dict(st)
    assert (other.step_count, other.skipped_nonfinite) == (1, 1)
    assert _same_opt_state(_opt_state(other), _opt_state(eng))
    assert other.optimizer.param_groups[0]["lr"] == eng.optimizer.param_groups[0]["lr"]


def test_sft_interface_reports_the_skip_count(path):
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.impl.model.interface.sft_interface import SFTInterface

    eng = _engine(path, skip=3)
    eng.skipped_nonfinite = 2  # as restored from a recover checkpoint
    b = _batch(eng.model.config.vocab_size, 0)
    pm = torch.cat([torch.arange(n) < 2 for n in LENS])
    sample = SequenceSample.from_default(ids=b.ids, seqlens=LENS, data={**b.data, "prompt_mask": pm})
    grid = type("Grid", (), {"dp_size": 1})()
    model = Model(name="default", engine=eng, tokenizer=None, grid=grid, path="")
    stats = SFTInterface().train_step(model, sample, MicroBatchSpec())
    assert stats["skipped_nonfinite"] == 2.0 and math.isfinite(stats["loss"])


# ----------------------------------------------------------------------------- several processes
def _dist_worker(path, layout):
    import torch.distributed as dist

    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import NonFiniteError

    grid = ParallelGrid(ParallelDims(*layout))
    out = {}
    # only ONE rank's micro-batch is bad (the last: with pp it is the stage that computes the loss), and its
    # gradients stay finite: only its loss tells
    bad = "nan_const" if dist.get_rank() == dist.get_world_size() - 1 else ""
    for skip in (1, 0):
        eng = _engine(path, skip, grid)
        tp = eng.model.tp_group
        vocab = eng.model.config.vocab_size

        def part(step):
            return _batch(vocab, step).split(grid.dp_size)[grid.dp_rank]

        eng.train_batch(part(0), _loss_fn(tp), _weight)
        params = eng.model.flat.detach().clone()
        try:
            st = eng.train_batch(part(1), _loss_fn(tp, bad), _weight)
        except NonFiniteError as e:
            out[skip] = {"raised": str(e), "unchanged": torch.equal(eng.model.flat, params)}
            continue
        res = {"skipped": st.skipped, "count": st.skipped_nonfinite, "unchanged": torch.equal(eng.model.flat, params)}
        st = eng.train_batch(part(2), _loss_fn(tp), _weight)
        res.update(next_skipped=st.skipped, next_loss=st.loss, params=eng.model.flat.detach().clone())
        out[skip] = res
    return out


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 1, 2), (1, 2, 1)], ids=["d2m1p1", "d1m1p2", "d1m2p1"])
def test_ranks_decide_alike(path, layout):
    res = run_distributed(_dist_worker, 2, path, layout, timeout=240)
    for r in res:
        assert r[1]["skipped"] and r[1]["count"] == 1 and r[1]["unchanged"], r[1]
        assert not r[1]["next_skipped"] and math.isfinite(r[1]["next_loss"])
        assert torch.isfinite(r[1]["params"]).all()
        assert "raised" in r[0] and "skip_nonfinite_steps=0" in r[0]["raised"] and r[0]["unchanged"], r[0]
    if layout[0] == 2:  # data-parallel replicas stay identical
        assert torch.equal(res[0][1]["params"], res[1][1]["params"])


# ----------------------------------------------------------------------------- end to end
def _sft_args(model, root, exp, *extra):
    data = os.path.join(root, "train.jsonl")
    r = random.Random(0)
    with open(data, "w") as f:
        for _ in range(48):
            a, b = r.randint(0, 9), r.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={data}", "dataset.train_bs_n_seqs=8",
            f"fileroot={root}", f"experiment_name={exp}", "allocation_mode=d1m1p1", "n_devices_per_node=1", *extra]


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_cli_rejects_a_nonfinite_lr_before_anything_starts(path, tmp_path, value):
    root = str(tmp_path)
    p = run_quickstart(_sft_args(path, root, "bad", f"model.optimizer.lr={value}"), timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    err = p.stderr
    assert "error: " in err and f"model.optimizer.lr={value}" in err and "finite" in err, err[-2000:]
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(root, "bad", "trial0", "logs", "master.log")), "workers were started"


def test_blown_up_sft_run_stops_and_saves_only_finite_checkpoints(path, tmp_path):
    from safetensors.torch import load_file

    root = str(tmp_path)
    # lr=1e30: the first update is finite but so large that the next forward pass overflows
    p = run_quickstart(_sft_args(path, root, "blowup", "model.optimizer.lr=1e30", "model.optimizer.gradient_clipping=0",
                                 "exp_ctrl.save_freq_steps=1"), timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"a run that blew up exited 0:\n{out[-3000:]}"
    assert "NonFiniteError" in out and "non-finite" in out and "grad_norm=" in out, out[-3000:]
    files = glob.glob(os.path.join(root, "blowup", "trial0", "checkpoints", "**", "*.safetensors"), recursive=True)
    assert files, "the first (finite) step should have been saved"
    for f in files:
        for name, t in load_file(f).items():
            assert torch.isfinite(t).all(), f"{f}: {name} has non-finite values"
