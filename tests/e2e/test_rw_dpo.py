"""Reward modelling (``rw``), DPO (``dpo``), preference data, and a trained reward model as ``rew_inf`` of ``ppo-math``.

The task: one-digit sums ``"3+4="``. A tiny model (2 layers, hidden 64) is first fine-tuned here on the right
answers (SFT, in this process, 200 steps: a few seconds), as a reward model or a DPO policy starts from an SFT model.
Preference pairs: the right answer is chosen, a wrong one (1 to 4 off) rejected; every such pair of the 100 prompts,
split at random into training pairs and held-out pairs (whose prompts the training pairs share, with other wrong
answers). Measured here: the reward model's held-out pairwise accuracy ~0.97 after 200 steps (0.5 at the start); DPO's
held-out log-ratio margin 0 -> ~8 and accuracy 0.5 -> ~0.9 in 100 steps.

The losses are checked against the papers' formulas written out here on hand-made numbers.
"""
import contextlib
import json
import math
import os
import random
import shutil
from types import SimpleNamespace

import pytest
import torch

from realhf.testing import read_stats, run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model

MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
             tie_word_embeddings=True, max_position_embeddings=64)
OFFSETS = (-4, -3, -2, -1, 1, 2, 3, 4)


# ------------------------------------------------------------------------------------------------ the losses
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_loss_is_the_papers():
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs (InstructGPT, eq. 1)."""
    from realhf.impl.model.interface.rw_interface import bradley_terry_loss, pair_accuracy

    chosen, rejected = [1.5, -0.25, 2.0, 0.0], [0.5, 0.75, 2.0, -3.0]
    want = sum(-math.log(_sigmoid(c - r)) for c, r in zip(chosen, rejected)) / 4
    got = bradley_terry_loss(torch.tensor(chosen), torch.tensor(rejected))
    assert abs(float(got) - want) < 1e-6, (float(got), want)
    # chosen above rejected twice, a tie (half), below once
    assert float(pair_accuracy(torch.tensor(chosen), torch.tensor(rejected))) == 2.5
    # the gradient pushes the chosen score up by sigmoid(-(c - r)) / n
    c = torch.tensor(chosen, requires_grad=True)
    bradley_terry_loss(c, torch.tensor(rejected)).backward()
    assert torch.allclose(c.grad, torch.tensor([-_sigmoid(-(x - y)) / 4 for x, y in zip(chosen, rejected)]))


def test_dpo_loss_is_the_papers():
    """-log sigmoid(beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))), averaged (DPO, eq. 7)."""
    from realhf.impl.model.interface.dpo_interface import dpo_loss

    pi_w, pi_l = [-3.0, -10.5, -1.25], [-4.0, -9.0, -7.5]
    ref_w, ref_l = [-3.5, -10.0, -2.0], [-3.5, -9.5, -6.0]
    for beta in (0.1, 0.5, 2.0):
        want = sum(-math.log(_sigmoid(beta * ((a - b) - (c - d)))) for a, c, b, d in zip(pi_w, pi_l, ref_w, ref_l)) / 3
        got = dpo_loss(*(torch.tensor(x) for x in (pi_w, pi_l, ref_w, ref_l)), beta=beta)
        assert abs(float(got) - want) < 1e-6, (beta, float(got), want)


# ------------------------------------------------------------------------------------------------ the task
def _pairs():
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + o)}
            for a in range(10) for b in range(10) for o in OFFSETS if a + b + o >= 0]
    random.Random(0).shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"p{i}"
    k = int(0.8 * len(rows))
    return rows[:k], rows[k:]


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@contextlib.contextmanager
def _one_thread():
    """Train in this process as a model worker does (cpus_per_worker=1): on a busy machine more threads only wait."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _sft(base: str, rows_path: str, out: str, steps: int = 200) -> str:
    """Fine-tune ``base`` on the right answers in this process (the sft interface and engine the workers run)."""
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.base.topology import single_process_grid
    from realhf.impl.dataset import EpochIterator, PromptAnswerDataset
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.backend.optim import OptimizerConfig
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf
    from realhf.impl.model.interface.sft_interface import SFTInterface

    torch.manual_seed(1)
    tok, grid = load_tokenizer(base), single_process_grid()
    module = build_from_hf(base, grid=grid, dtype=torch.float32)
    model = Model("default", TrainEngine(module, OptimizerConfig(lr=3e-3, gradient_clipping=1.0), steps), tok, grid, base)
    it = EpochIterator(PromptAnswerDataset(rows_path, tok, 16), 32, seed=1)
    with _one_thread():
        for _ in range(steps):
            SFTInterface().train_step(model, it.next_batch(), MicroBatchSpec())
    save_hf(module, out, tokenizer_src=base)
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    d = tmp_path_factory.mktemp("rw_dpo")
    base = ensure_tiny_model("qwen2", seed=1, **MODEL)
    sums = _write(d / "sums.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)])
    train, held = _pairs()
    sft = _sft(base, sums, str(d / "sft"))
    # an untrained reward model (a fresh scalar head on the SFT model): enough for the checks before start
    rm = str(d / "rm-untrained")
    save_hf(build_from_hf(sft, grid=single_process_grid(), dtype=torch.float32, is_critic=True), rm, tokenizer_src=sft)
    return SimpleNamespace(dir=d, base=base, sft=sft, rm=rm, train=_write(d / "train.jsonl", train),
                           held=_write(d / "heldout.jsonl", held), n_held=len(held), root=str(d / "runs"))


def _scores_hf(path, tok, rows):
    """Each row's chosen and rejected scores by transformers' AutoModelForSequenceClassification (one at a time)."""
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for r in rows:
            p = tok(r["prompt"])["input_ids"]
            out.append([float(hf(torch.tensor([p + tok(r[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
                                 ).logits[0, 0]) for k in ("chosen", "rejected")])
    return out


def test_rw_learns_the_preferences_and_saves_a_transformers_reward_model(task):
    """A real rw run (launcher, master, model worker) from the SFT model: held-out pairwise accuracy >= 0.9; the
    checkpoint is a Qwen2ForSequenceClassification folder whose scores transformers reproduces, and the reward
    interface (rew_inf of ppo-math) scores the same in micro-batches."""
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.base.topology import single_process_grid
    from realhf.impl.dataset.preference import PreferenceDataset
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.rw_interface import RewardModelInterface, split_pairs

    p = run_quickstart(["rw", f"model.path={task.sft}", f"dataset.train_path={task.train}",
                        f"dataset.valid_path={task.held}", "dataset.max_seqlen=16", "dataset.train_bs_n_seqs=32",
                        "dataset.valid_bs_n_seqs=256", "model.optimizer.lr=1e-3", "exp_ctrl.total_train_epochs=20",
                        "exp_ctrl.benchmark_steps=200", "exp_ctrl.eval_freq_epochs=1000", "exp_ctrl.eval_freq_steps=200",
                        "exp_ctrl.save_freq_steps=200", f"fileroot={task.root}", "experiment_name=rw-sums"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = read_stats(task.root, "rw-sums")
    assert len(st) == 200 and st[-1]["eval_pairs"] == task.n_held
    print(f"rw: held-out pairwise accuracy {st[-1]['eval_accuracy']:.3f} after {len(st)} steps")
    assert st[-1]["eval_accuracy"] >= 0.9, [(s.get("eval_accuracy"), s["accuracy"]) for s in st[::20]]
    ckpt_dir = os.path.join(task.root, "rw-sums", "trial0", "checkpoints", "default")
    ckpt = os.path.join(ckpt_dir, os.listdir(ckpt_dir)[0])
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForSequenceClassification"]
    tok = load_tokenizer(ckpt)
    with open(task.held) as f:
        rows = [json.loads(line) for line in f][:12]
    hf = _scores_hf(ckpt, tok, rows)
    # rew_inf's interface on the checkpoint, three micro-batches: one reward per sequence, its last token's score
    grid = single_process_grid()
    model = Model("reward", InferenceEngine(build_from_hf(ckpt, grid=grid, dtype=torch.float32, is_critic=True)), tok,
                  grid, ckpt)
    ds = PreferenceDataset(_write(task.dir / "some.jsonl", rows), tok, 16)
    out = RewardModelInterface(reward_output_scaling=2.0, reward_output_bias=0.5).inference(
        model, ds.collate([ds[i] for i in range(len(ds))]), MicroBatchSpec(n_mbs=3))
    assert out.seqlens["rewards"] == [[1, 1]] * len(rows)
    chosen, rejected = split_pairs(out.data["rewards"] / 2.0 - 0.5)
    assert torch.allclose(torch.stack([chosen, rejected], 1), torch.tensor(hf), atol=1e-4), (chosen, rejected, hf)


def test_dpo_raises_the_margin_and_accuracy_on_held_out_pairs(task):
    """DPO with the dpo interface (ref_inf's reference log-probs, actor_train's loss, the evaluation that loads the
    reference) from the SFT model: on held-out pairs the log-ratio margin starts at 0 and accuracy at 0.5 (the policy
    is the reference) and both rise. A sequence's log-prob is the sum over its answer tokens only."""
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.base.topology import single_process_grid
    from realhf.impl.dataset import EpochIterator
    from realhf.impl.dataset.preference import PreferenceDataset
    from realhf.impl.model.backend.engine import InferenceEngine, TrainEngine
    from realhf.impl.model.backend.optim import OptimizerConfig
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.interface.dpo_interface import DPOInterface

    torch.manual_seed(1)
    tok, grid, steps = load_tokenizer(task.sft), single_process_grid(), 40
    policy = Model("actor", TrainEngine(build_from_hf(task.sft, grid=grid, dtype=torch.float32),
                                        OptimizerConfig(lr=1e-3, gradient_clipping=1.0), steps), tok, grid, task.sft)
    ref = Model("ref", InferenceEngine(build_from_hf(task.sft, grid=grid, dtype=torch.float32)), tok, grid, task.sft)
    iface = DPOInterface(beta=0.1, ref_path=task.sft)
    held = PreferenceDataset(task.held, tok, 16)
    valid = [held.collate([held[i] for i in range(len(held))])]

    # the reference's sums are the answer tokens' log-probs (with EOS), not the prompt's
    lp = iface.inference(ref, valid[0], MicroBatchSpec(n_mbs=4)).data["seq_ref_logprobs"]
    with torch.no_grad():
        for i in (0, 1, 7):
            it = held[i]
            for j, seq in enumerate((it["chosen_ids"], it["rejected_ids"])):
                logits = ref.module(torch.tensor(seq), _packed([len(seq)]))
                full = torch.log_softmax(logits.float(), -1)
                want = sum(float(full[t - 1, seq[t]]) for t in range(it["prompt_len"], len(seq)))
                assert abs(float(lp[2 * i + j]) - want) < 1e-4, (i, j, float(lp[2 * i + j]), want)

    before = iface.evaluate(policy, valid)
    assert before["eval_margin"] == 0.0 and before["eval_accuracy"] == 0.5 and before["eval_pairs"] == task.n_held
    data = PreferenceDataset(task.train, tok, 16)
    it = EpochIterator(data, 32, seed=1)
    with _one_thread():
        for _ in range(steps):
            b = it.next_batch()
            b.update_(iface.inference(ref, b, MicroBatchSpec()))
            st = iface.train_step(policy, b, MicroBatchSpec(n_mbs=2))
    after = iface.evaluate(policy, valid)
    print(f"dpo: held-out margin {before['eval_margin']:.3f} -> {after['eval_margin']:.3f}, accuracy "
          f"{before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f} in {steps} steps")
    assert after["eval_margin"] > 2.0 and after["eval_accuracy"] >= 0.8, (before, after)
    assert after["eval_loss"] < before["eval_loss"] - 0.1 and st["accuracy"] > 0.7, (before, after, st)


def _packed(lens):
    from realhf.impl.model.nn.real_model import make_packed_input

    return make_packed_input(lens)


# ------------------------------------------------------------------------------------------------ before start
def _build(exp, *overrides):
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, registered

    return build_spec(exp, load_config(registered()[exp], [], list(overrides)))


def test_preference_rows_are_refused_before_start_with_file_and_line(task):
    from realhf.impl.dataset import DatasetError

    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    cases = [({"prompt": "1+1=", "chosen": "2"}, "missing field 'rejected'"),
             ({**good, "rejected": "2"}, "'chosen' and 'rejected' are the same text"),
             ({**good, "chosen": 2}, "field 'chosen' must be a string"),
             ({**good, "rejected": "  "}, "field 'rejected' is empty")]
    for i, (bad, what) in enumerate(cases):
        path = _write(task.dir / f"bad{i}.jsonl", [good, good, bad])
        for exp, args in (("rw", [f"model.path={task.sft}", f"dataset.train_path={task.train}",
                                  f"dataset.valid_path={path}"]),
                          ("dpo", [f"actor.path={task.sft}", f"dataset.train_path={path}"])):
            with pytest.raises(DatasetError, match=f"{path}:3: {what}"):
                _build(exp, *args, "dataset.max_seqlen=16", f"fileroot={task.root}")


def _ppo(task, *overrides):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    math_path = str(task.dir / "math.jsonl")
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="easy"), math_path)
    return _build("ppo-math", f"actor.path={task.sft}", f"dataset.path={math_path}", f"fileroot={task.root}",
                  "use_critic=false", "dataset.max_prompt_len=16", "ppo.gen.max_new_tokens=4", *overrides)


def test_reward_model_of_ppo_math_is_checked_before_start(task):
    """reward.type=model takes a reward model of the policy's tokenizer; rew_inf then runs it with its micro-batches."""
    from realhf.api.quickstart.entry import ConfigError

    spec = _ppo(task, "reward.type=model", f"reward.model.path={task.rm}", "rew_inf.mb_spec.n_mbs=3")
    rew = next(m for m in spec.mfcs if m.name == "rew_inf")
    assert rew.interface_impl == "rw" and rew.mb_spec.n_mbs == 3 and spec.model("reward").is_critic
    assert spec.model("reward").path == task.rm
    # a language model has no scalar head
    with pytest.raises(ValueError, match="reward.model.path=.* has no scalar head"):
        _ppo(task, "reward.type=model", f"reward.model.path={task.sft}")
    # the same model with another tokenizer: two token ids swapped in its vocabulary
    other = str(task.dir / "rm-other-tokenizer")
    shutil.copytree(task.rm, other, dirs_exist_ok=True)
    with open(os.path.join(other, "tokenizer.json")) as f:
        t = json.load(f)
    vocab = t["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(t, f)
    with pytest.raises(ValueError, match="its tokenizer is not the policy's .*token '[78]'"):
        _ppo(task, "reward.type=model", f"reward.model.path={other}")
    # options that would be silently unused are refused, naming the key
    for args, key in (((f"reward.model.path={task.rm}",), "reward.model.path"),
                      (("rew_inf.mb_spec.n_mbs=2",), "rew_inf.mb_spec.n_mbs"),
                      (("reward.type=model", f"reward.model.path={task.rm}", "reward.correct_reward=1.0"),
                       "reward.correct_reward"),
                      (("reward.type=model",), "reward.model.path")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            _ppo(task, *args)
    with pytest.raises(ConfigError, match="reward.type=model .* rew_inf"):
        _build("async-ppo-math", f"actor.path={task.sft}", f"dataset.path={task.dir / 'math.jsonl'}",
               "n_devices_per_node=2", "allocation_mode=gen.d1m1p1+d1m1p1", f"fileroot={task.root}",
               "reward.type=model", f"reward.model.path={task.rm}")


def test_memory_plan_knows_the_new_mfcs(task, monkeypatch):
    """The launcher's memory plan has a workload for rw's training (two sequences a pair), dpo's ref_inf and
    actor_train, and ppo-math's reward model (rew_inf), and resolves their max_tokens_per_mb=auto."""
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, registered
    from realhf.experiments.memory_plan import plan_run, workloads

    _ppo(task)  # writes the math prompts
    cases = {"rw": ([f"model.path={task.sft}", f"dataset.train_path={task.train}"], {"trainDefault": "mb_spec"}),
             "dpo": ([f"actor.path={task.sft}", f"dataset.train_path={task.train}"],
                     {"actor_train": "actor_train.mb_spec", "ref_inf": "ref_inf.mb_spec"}),
             "ppo-math": ([f"actor.path={task.sft}", f"dataset.path={task.dir / 'math.jsonl'}", "use_critic=false",
                           "dataset.max_prompt_len=16", "ppo.gen.max_new_tokens=4", "reward.type=model",
                           f"reward.model.path={task.rm}", "group_size=4"], {"rew_inf": "rew_inf.mb_spec"})}
    monkeypatch.setenv("REALHF_DEVICE_MEMORY_GIB", "16")
    for exp, (args, mfcs) in cases.items():
        extra = ["dataset.max_seqlen=16", "dataset.train_bs_n_seqs=8"] if exp != "ppo-math" else ["dataset.train_bs_n_seqs=2"]
        cfg = load_config(registered()[exp], [], args + extra + [f"fileroot={task.root}"])
        work = workloads(cfg)
        seqs = 2 * 8 if exp != "ppo-math" else 2 * 4
        assert all(work[m].seqs == seqs for m in mfcs) and set(mfcs) <= set(work), (exp, work)
        resolved, spec, plan = plan_run(exp, cfg, lambda c, e=exp: build_spec(e, c))
        for mfc, key in mfcs.items():
            mb = resolved
            for part in key.split("."):
                mb = getattr(mb, part)
            assert isinstance(mb.max_tokens_per_mb, int), (exp, key, mb)
            assert any(c.mfc == mfc for c in plan.calls), (exp, mfc, [c.mfc for c in plan.calls])


# ------------------------------------------------------------------------------------------------ slow: whole runs
@pytest.mark.slow
def test_dpo_run_raises_the_margin_and_accuracy_on_held_out_pairs(task):
    """A real dpo run (the policy and the reference as two models, ref_inf then actor_train): the held-out log-ratio
    margin and pairwise accuracy rise. The run starts with the policy equal to the reference (margin 0, accuracy 0.5:
    the in-process test checks that); its first evaluation comes after 2 steps, when accuracy has already risen, so the
    accuracy is compared with the start and must not fall after the first evaluation, and the margin must keep rising."""
    p = run_quickstart(["dpo", f"actor.path={task.sft}", f"dataset.train_path={task.train}",
                        f"dataset.valid_path={task.held}", "dataset.max_seqlen=16", "dataset.train_bs_n_seqs=32",
                        "dataset.valid_bs_n_seqs=256", "actor.optimizer.lr=1e-3", "dpo.beta=0.1",
                        "exp_ctrl.total_train_epochs=5", "exp_ctrl.benchmark_steps=60", "exp_ctrl.eval_freq_epochs=1000",
                        "exp_ctrl.eval_freq_steps=2", "exp_ctrl.save_freq_steps=60", f"fileroot={task.root}",
                        "experiment_name=dpo-sums"], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ev = [s for s in read_stats(task.root, "dpo-sums") if "eval_margin" in s]
    first, last = ev[0], ev[-1]
    print(f"dpo run: held-out margin {first['eval_margin']:.3f} -> {last['eval_margin']:.3f}, accuracy "
          f"{first['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f} ({len(ev)} evaluations)")
    assert len(ev) == 30 and last["eval_pairs"] == task.n_held
    assert first["eval_margin"] > 0 and last["eval_margin"] > first["eval_margin"] + 2.0, (first, last)
    assert last["eval_accuracy"] >= max(0.5 + 0.3, first["eval_accuracy"]), (first, last)
    assert os.listdir(os.path.join(task.root, "dpo-sums", "trial0", "checkpoints", "actor"))


@pytest.mark.slow
def test_ppo_math_learns_tiny_arithmetic_from_a_trained_reward_model(tiny_arith_start):
    """The tiny arithmetic recipe (tests/e2e/test_grpo_learns.py) with the grader replaced by a reward model: rw trains it
    from the SFT checkpoint on right-vs-wrong answers to the RL prompts, then GRPO with reward.type=model raises the
    held-out greedy accuracy (graded by the rule-based grader, which the run never sees)."""
    from realhf.testing import tiny_arith_recipe
    from realhf.impl.dataset.preference import preference_rows_from_math

    recipe = tiny_arith_recipe()
    start = tiny_arith_start  # the SFT start of the learning tests (tests/conftest.py)
    out = start["out"]
    with open(start["data"]["paths"]["rl"]) as f:
        rl = [json.loads(line) for line in f]
    train = _write(os.path.join(out, "pairs.jsonl"), preference_rows_from_math(rl, seed=1))
    held = _write(os.path.join(out, "pairs_heldout.jsonl"), preference_rows_from_math(start["data"]["test"], seed=2))
    root = os.path.join(out, "runs")
    p = run_quickstart(["rw", f"model.path={start['sft_ckpt']}", f"dataset.train_path={train}",
                        f"dataset.valid_path={held}", "dataset.max_seqlen=16", "dataset.train_bs_n_seqs=32",
                        "dataset.valid_bs_n_seqs=200", "model.optimizer.lr=1e-3", "exp_ctrl.total_train_epochs=10",
                        "exp_ctrl.benchmark_steps=400", "exp_ctrl.eval_freq_epochs=1000", "exp_ctrl.eval_freq_steps=100",
                        "exp_ctrl.save_freq_steps=400", f"fileroot={root}", "experiment_name=rm-tiny-arith"], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ev = [s["eval_accuracy"] for s in read_stats(root, "rm-tiny-arith") if "eval_accuracy" in s]
    print(f"reward model: held-out pairwise accuracy {ev}")
    assert ev[-1] >= 0.9, ev
    rm = recipe.last_checkpoint(os.path.join(root, "rm-tiny-arith", "trial0"), "default")
    res = recipe.learn("grpo", out, start, overrides=["reward.type=model", f"reward.model.path={rm}",
                                                      "reward.allow_last_number=false"],
                       exp="grpo-rm-tiny-arith", eval_threads=None)
    before, after = start["heldout_acc_before"], res["heldout_acc_after"]
    print(f"grpo with the reward model: held-out greedy accuracy {before:.1%} -> {after:.1%} in {res['steps']} steps")
    assert res["steps"] == 40 and "rew_inf/time" in res["stats"][0]
    assert after >= before + 0.25 and after >= 0.6, (before, after)
