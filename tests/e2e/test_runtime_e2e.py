"""The ReaL runtime end to end: quickstart CLI -> local launcher -> master + model workers over ZMQ.

Every run here starts real processes (master, model workers), real gloo groups and real ZMQ sockets.
"""
import glob
import json
import os
import random
import signal

import pytest
import torch

from realhf.testing import run_quickstart, run_worker, start_quickstart, wait_for_steps, wait_until_gone
from realhf.impl.model.tiny import ensure_tiny_model


def _write_sft(path, n, seed):
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = r.randint(0, 9), r.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    _write_sft(d / "train.jsonl", 48, 0)
    _write_sft(d / "valid.jsonl", 8, 1)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"Tom has {i} apples and buys {i + 3} more.", "query_id": f"q{i}"}) + "\n")
    return d


def quickstart(args, timeout=300, check=True):
    p = run_quickstart(args, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"quickstart {args[0]} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def stats(root, exp):
    with open(os.path.join(root, exp, "trial0", "logs", "stats.jsonl")) as f:
        return [json.loads(l) for l in f]


def n_devices(layout):
    import re

    return eval("*".join(re.findall(r"\d+", layout)))  # noqa: S307 (digits only)


def sft_args(model, data, root, exp, layout, *extra):
    return ["sft", f"model.path={model}", "dataset.max_seqlen=512", f"dataset.train_path={data}/train.jsonl", "dataset.train_bs_n_seqs=8",
            "model.optimizer.lr=1e-3", "model.optimizer.gradient_clipping=0", f"fileroot={root}", f"experiment_name={exp}",
            f"allocation_mode={layout}", f"n_devices_per_node={n_devices(layout)}", *extra]


@pytest.fixture(scope="module")
def model():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


# a data-parallel SFT run of 18 steps (3 epochs of 6), evaluated every epoch, saved at its end, with a recover
# checkpoint every 5 steps: the run of test_sft_learns_and_layouts_agree and the uninterrupted reference of
# test_kill_worker_fails_fast_and_auto_recovery_matches
D2_RUN = ("d2m1p1", "exp_ctrl.total_train_epochs=3", "exp_ctrl.save_freq_epochs=3", "exp_ctrl.ckpt_freq_steps=5")


def d2_args(model, data, root, exp, *extra):
    return sft_args(model, data, root, exp, *D2_RUN, f"dataset.valid_path={data}/valid.jsonl", *extra)


@pytest.fixture(scope="module")
def d2_run(model, data, tmp_path_factory):
    """The fileroot holding the finished run "d2" (``D2_RUN``)."""
    root = str(tmp_path_factory.mktemp("d2"))
    quickstart(d2_args(model, data, root, "d2"))
    return root


def test_sft_learns_and_layouts_agree(model, data, d2_run, tmp_path):
    import transformers

    root = d2_run
    st = stats(root, "d2")
    losses = [s["loss"] for s in st if "loss" in s]
    assert len(losses) == 18 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    evals = [s["eval_loss"] for s in st if "eval_loss" in s]
    assert len(evals) == 3 and evals[-1] < evals[0], evals
    events = glob.glob(os.path.join(root, "d2", "trial0", "logs", "tensorboard", "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0, "TensorBoard event file missing"
    saved = glob.glob(os.path.join(root, "d2", "trial0", "checkpoints", "default", "*"))
    assert len(saved) == 1
    m = transformers.AutoModelForCausalLM.from_pretrained(saved[0])
    assert torch.isfinite(m(torch.tensor([[1, 2, 3]])).logits).all()
    # the same first steps in one process (same data order: the global batch is layout independent)
    root = str(tmp_path)
    quickstart(sft_args(model, data, root, "d1m1p1", "d1m1p1", "exp_ctrl.benchmark_steps=3"))
    for a, b in zip([s["loss"] for s in stats(root, "d1m1p1")], losses[:3]):
        assert abs(a - b) < 1e-4, "data-parallel training must give the same losses as one process"


@pytest.mark.slow  # tests/unit/test_model_train.py proves the same update in every layout in-process
@pytest.mark.parametrize("layout", ["d1m2p1", "d1m1p2"])
def test_sft_first_steps_equal_in_every_layout(model, data, tmp_path, layout):
    root = str(tmp_path)
    first = {}
    for lay in ("d1m1p1", layout):
        quickstart(sft_args(model, data, root, lay, lay, "exp_ctrl.benchmark_steps=3"))
        first[lay] = [s["loss"] for s in stats(root, lay)]
    for a, b in zip(first[layout], first["d1m1p1"]):
        assert abs(a - b) < 1e-4, f"{layout} loss {first[layout]} vs d1m1p1 {first['d1m1p1']}"


GEN_LAYOUTS = ["d2m1p1", pytest.param("d1m2p1", marks=pytest.mark.slow), pytest.param("d1m1p2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("other", GEN_LAYOUTS)  # tp and pp generation: also in-process in test_generation.py
def test_gen_layouts_identical_and_equal_transformers(model, data, tmp_path, other):
    import transformers

    root = str(tmp_path)
    outs = {}
    for layout in ("d1m1p1", other):
        quickstart(["gen", f"model.path={model}", f"dataset.path={data}/prompts.jsonl", "dataset.train_bs_n_seqs=4",
                    "gen.max_new_tokens=10", "gen.greedy=true", "use_chat_template=false", f"fileroot={root}",
                    f"experiment_name=gen{layout}", f"allocation_mode={layout}", f"n_devices_per_node={n_devices(layout)}"])
        with open(os.path.join(root, f"gen{layout}", "trial0", "logs", "generated.jsonl")) as f:
            outs[layout] = [json.loads(l) for l in f]
    ref = outs["d1m1p1"]
    assert [r["query_id"] for r in ref] == [f"q{i}" for i in range(6)]  # 6 prompts: a batch of 4, then one of 2
    for layout, rows in outs.items():
        assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in ref], f"{layout} differs from d1m1p1"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    for r in ref:
        ids = tok(r["prompt"])["input_ids"]
        o = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
        assert o[0, len(ids):].tolist() == r["output_ids"]
        assert r["output_text"] == tok.decode(r["output_ids"], skip_special_tokens=True)
        assert len(r["logprobs"]) == len(r["output_ids"])


def _load_saved(root, exp):
    from safetensors.torch import load_file

    path = glob.glob(os.path.join(root, exp, "trial0", "checkpoints", "default", "*"))
    assert len(path) == 1, path
    sd = {}
    for f in glob.glob(os.path.join(path[0], "*.safetensors")):
        sd.update(load_file(f))
    return sd


def test_kill_worker_fails_fast_and_auto_recovery_matches(model, data, d2_run, tmp_path):
    root = str(tmp_path)

    def launch(exp, mode):
        return start_quickstart(d2_args(model, data, root, exp, f"recover_mode={mode}"))

    def kill_worker_after(exp, n_steps, proc):
        wait_for_steps(root, exp, n_steps, proc=proc)
        run_worker(os.path.join(root, exp), 1).send_signal(signal.SIGKILL)

    # 1. no recovery: the run fails fast (the timeout is a hang detector), naming the worker, and leaves no
    # process behind
    p = launch("killed", "disabled")
    kill_worker_after("killed", 7, p)
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0
    assert "model_worker_1" in out and "-9" in out, out[-2000:]
    assert not wait_until_gone(os.path.join(root, "killed")), "processes left behind"
    # 2. recover_mode=auto: relaunch, resume from the last recover checkpoint, the final parameters of the
    # uninterrupted run
    p = launch("auto", "auto")
    kill_worker_after("auto", 7, p)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    assert "relaunching" in out and "resum" in out
    ref, got = _load_saved(d2_run, "d2"), _load_saved(root, "auto")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.allclose(ref[k], got[k], atol=1e-5), f"{k} differs after recovery"
    steps = [s["global_step"] for s in stats(root, "auto")]
    assert steps == list(range(1, 19)), "every step of the run must appear exactly once, in order, after resume"
    # the crashed attempt's steps after its recover checkpoint (redone after the resume) are kept aside
    aside = glob.glob(os.path.join(root, "auto", "trial0", "logs", "stats.before-*.jsonl"))
    assert len(aside) == 1
    with open(aside[0]) as f:
        redone = [json.loads(l)["global_step"] for l in f]
    # consecutive steps starting just after a recover checkpoint (every 5 steps)
    assert redone and redone[0] % 5 == 1 and redone == list(range(redone[0], redone[0] + len(redone))), redone
    assert not wait_until_gone(os.path.join(root, "auto"))


@pytest.mark.parametrize(
    "override,needle",
    [
        (["model.optimizer.lrr=1e-3"], "model.optimizer.lr"),
        (["model.optimizer.lr=-1"], "lr"),
        (["allocation_mode=d4m1p1", "n_devices_per_node=4", "dataset.train_bs_n_seqs=2"], "train_bs_n_seqs=2"),
        (["dataset.train_path=/nonexistent/train.jsonl"], "/nonexistent/train.jsonl"),
        (["bad_line"], "bad.jsonl:3"),
    ],
    ids=["unknown-key", "negative-lr", "batch-smaller-than-dp", "missing-dataset", "malformed-line"],
)
def test_bad_input_fails_before_any_worker_starts(model, data, tmp_path, override, needle):
    root = str(tmp_path)
    if override == ["bad_line"]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=" "answer": 6}\n')
        override = [f"dataset.train_path={bad}"]
    p = quickstart(sft_args(model, data, root, "bad", "d1m1p1") + override, check=False, timeout=120)
    assert p.returncode != 0
    assert needle in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(root, "bad", "trial0", "logs", "master.log")), "workers were started"


def test_dfg_key_nobody_produces_is_rejected():
    from realhf.api.core.dfg import MFCDef, build_graph

    mfcs = [MFCDef(name="train", model_name="default", interface_type="train_step", interface_impl="sft",
                   input_keys=("packed_input_ids", "rewards"))]
    with pytest.raises(ValueError, match="rewards"):
        build_graph(mfcs, {"packed_input_ids", "prompt_mask"})


def test_forged_message_is_rejected_and_run_goes_on(model, data, tmp_path):
    import zmq

    from realhf.base import name_resolve
    from realhf.base.name_resolve import names

    root = str(tmp_path)
    args = sft_args(model, data, root, "forge", "d1m1p1", "dataset.train_bs_n_seqs=2", "exp_ctrl.total_train_epochs=3")
    p = start_quickstart(args)
    nr = name_resolve.make_repository("file", root=os.path.join(root, "name_resolve"))
    addr = nr.wait(names.worker_address("forge", "trial0", "model_worker_0"), timeout=120)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    header = json.dumps({"handler": "model_worker_0", "handle_name": "exit", "request_id": "x", "data": {},
                         "tensors": [], "error": None}).encode()
    sock.send_multipart([b"RHF1", b"\0" * 32, header])
    sock.send_multipart([b"hello"])
    out, _ = p.communicate(timeout=240)
    sock.close()
    assert p.returncode == 0, out[-3000:]
    log = open(os.path.join(root, "forge", "trial0", "logs", "model_worker_0.log")).read()
    assert "reject" in log.lower(), "the forged message should be logged as rejected"
    assert len(stats(root, "forge")) == 72, "the run must complete every step"
