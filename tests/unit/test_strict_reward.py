"""Strict reward: the final answer must be stated (``\\boxed{N}`` or "The answer is N") and the answer
must end (a stop token within max_new_tokens).

With ``reward_allow_last_number=false`` and ``reward_unfinished_as_wrong=true``: an unfinished answer (no EOS) scores
wrong even when it boxes the right number; an answer that ends without stating its answer scores wrong; a stated
wrong answer scores wrong; a stated right answer that ends scores right. Checked on both paths, each built from an
experiment spec as the workers build it: a synchronous run's ``rw-math`` interface (``rew_inf``, fed an actor_gen
sample through a real tokenizer) and an asynchronous run's ``rlvr`` workflow with the reward the rollout workers
build from the spec's ``reward_args``. And the held-out grading of ``realhf.experiments.math_eval`` (strict:
``require_eos``, no last-number fallback): accuracy per problem kind, the EOS rate, answer lengths and examples.
"""
import asyncio
import json

import pytest
import torch

from realhf.impl.model.tiny import ensure_tiny_model

SOLUTION = "12"
# (answer text, ends with EOS, right under the strict rule)
ANSWERS = [
    ("5 + 7 = 12, so the answer is \\boxed{12}", False, False),  # right number, but cut before it ended
    ("Mia has 5 and buys 7 more, so 12 apples.", True, False),  # ends, but never states the answer
    ("5 + 7 = 11. The answer is 11.", True, False),  # stated, wrong
    ("5 + 7 = 12. The answer is 12.", True, True),  # stated, right, ends
    ("5 + 7 = 12, so \\boxed{12}", True, True),
]
CORRECT, WRONG, SCALE, BIAS = 3.0, -2.0, 0.5, 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import transformers

    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    d = tmp_path_factory.mktemp("strict")
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    path = str(d / "math.jsonl")
    write_math_jsonl(make_arithmetic_problems(8, seed=1, kind="add"), path)
    return dict(model=model, data=path, root=str(d / "root"), tok=transformers.AutoTokenizer.from_pretrained(model))


def _spec(env, exp, *overrides):
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, registered

    base = [f"actor.path={env['model']}", f"dataset.path={env['data']}", f"fileroot={env['root']}",
            f"correct_reward={CORRECT}", f"wrong_reward={WRONG}", "reward_allow_last_number=false",
            f"ppo.reward_output_scaling={SCALE}", f"ppo.reward_output_bias={BIAS}"]
    if exp == "async-ppo-math":
        base += ["n_devices_per_node=2", "allocation_mode=gen.d1m1p1+d1m1p1"]
    return build_spec(exp, load_config(registered()[exp], [], base + list(overrides)))


def _answer_ids(tok, text, ends):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids + [tok.eos_token_id] if ends else ids


def _actor_gen_sample(tok, answers):
    """What actor_gen outputs for one prompt and a group of answers, with the dataset's metadata."""
    from realhf.api.core.data_api import SequenceSample

    prompt = tok.apply_chat_template([{"role": "user", "content": "Mia has 5 apples and buys 7 more. How many?"}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    seqs = [prompt + _answer_ids(tok, t, e) for t, e, _ in answers]
    keys = ("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask")
    data = {"packed_input_ids": torch.tensor([t for s in seqs for t in s]),
            "packed_logprobs": torch.zeros(sum(len(s) for s in seqs)),
            "prompt_mask": torch.tensor([i < len(prompt) for s in seqs for i in range(len(s))]),
            "seq_no_eos_mask": torch.tensor([not e for _, e, _ in answers])}
    return SequenceSample(keys=set(keys), ids=["q0"],
                          seqlens={**{k: [[len(s) for s in seqs]] for k in keys[:3]},
                                   "seq_no_eos_mask": [[1] * len(seqs)]},
                          trailing_shapes={k: () for k in keys}, dtypes={k: v.dtype for k, v in data.items()},
                          data=data, metadata={"solutions": [[SOLUTION]]})


def _rw_math(env, *overrides):
    from types import SimpleNamespace

    from realhf.system.trainer.model_worker import make_interfaces

    spec = _spec(env, "ppo-math", "use_critic=false", *overrides)
    mfc = next(m for m in spec.mfcs if m.name == "rew_inf")
    iface = make_interfaces([mfc])["rew_inf"]
    sample = _actor_gen_sample(env["tok"], ANSWERS).select(mfc.input_keys)  # what the MFC is handed
    try:
        out = iface.inference(SimpleNamespace(tokenizer=env["tok"]), sample, None)
    finally:
        if iface._verifier is not None:
            iface._verifier.close()
    return mfc, iface, out.data["rewards"].tolist()


def _expected(rights):
    return [pytest.approx(((CORRECT if r else WRONG) + BIAS) * SCALE) for r in rights]


def test_rw_math_strict(env):
    mfc, iface, rewards = _rw_math(env, "reward_unfinished_as_wrong=true")
    assert "seq_no_eos_mask" in mfc.input_keys
    assert rewards == _expected([r for _, _, r in ANSWERS])
    assert iface.last_stats["n_unfinished"] == 1.0
    # the same answers without the rule: the cut answer boxed the right number and counts
    mfc, iface, rewards = _rw_math(env)
    assert "seq_no_eos_mask" not in mfc.input_keys and "n_unfinished" not in iface.last_stats
    assert rewards == _expected([True, False, False, True, True])


def test_rw_math_needs_the_no_eos_mask(env):
    from types import SimpleNamespace

    from realhf.api.core.model_api import make_interface

    iface = make_interface("rw-math", correct_reward=1.0, wrong_reward=0.0, reward_output_scaling=1.0,
                           reward_output_bias=0.0, timeout_secs=5.0, allow_last_number=False, unfinished_as_wrong=True)
    sample = _actor_gen_sample(env["tok"], ANSWERS).select(("packed_input_ids", "prompt_mask"))
    with pytest.raises(KeyError, match="seq_no_eos_mask"):
        iface.inference(SimpleNamespace(tokenizer=env["tok"]), sample, None)


class ScriptedEngine:
    version = 0

    def __init__(self, outs):
        self.outs = outs

    async def agenerate(self, input_ids, sampling, rid, prefer=None):
        from realhf.gen_server.api import GenerateResult

        assert sampling.n == len(self.outs)
        return GenerateResult(rid=rid, outputs=self.outs)


def _rlvr_rewards(env, *overrides):
    """The rewards of one rlvr episode over ANSWERS, with the workflow and reward built as a rollout worker builds
    them from the spec, then scaled and biased as it does."""
    from realhf.api.core.workflow_api import make_workflow
    from realhf.gen_server.api import SampleOutput
    from realhf.impl.workflow.rewards import load_reward_fn

    rs = _spec(env, "async-ppo-math", "use_critic=false", f"group_size={len(ANSWERS)}", *overrides).rollout
    tok = env["tok"]
    reward = load_reward_fn(rs.reward_fn, **rs.reward_args)
    wf = make_workflow(rs.workflow, reward_fn=reward, gconfig=dict(rs.gconfig), tokenizer=tok)
    outs = []
    for text, ends, _ in ANSWERS:
        ids = _answer_ids(tok, text, ends)
        outs.append(SampleOutput(ids, [-0.1] * len(ids), [0] * len(ids), "stop" if ends else "length"))
    data = {"query_id": "q0", "input_ids": [5, 6, 7], "solutions": [SOLUTION]}
    try:
        traj = asyncio.run(wf.arun_episode(ScriptedEngine(outs), data))
        stats = reward.stats
    finally:
        reward.close()
    assert [s.no_eos for s in traj.samples] == [not e for _, e, _ in ANSWERS]
    assert rs.reward_output_scaling == SCALE and rs.reward_output_bias == BIAS
    return [(r + rs.reward_output_bias) * rs.reward_output_scaling for r in traj.rewards()], stats


def test_rlvr_strict(env):
    rewards, stats = _rlvr_rewards(env, "reward_unfinished_as_wrong=true")
    assert rewards == _expected([r for _, _, r in ANSWERS])
    assert stats["unfinished"] == 1 and stats["total"] == len(ANSWERS) - 1  # the cut answer is not graded
    rewards, stats = _rlvr_rewards(env)
    assert rewards == _expected([True, False, False, True, True]) and stats["unfinished"] == 0


def test_math_reward_sees_how_the_answer_ended():
    from realhf.impl.workflow.rewards import MathReward, call_reward

    seen = []

    def user_reward(text, data):
        seen.append(data.get("finish_reason"))
        return 1.0

    data = {"query_id": "q", "solutions": ["4"]}
    r = MathReward(correct_reward=1.0, wrong_reward=0.0, unfinished_as_wrong=True)
    try:
        async def go():
            return [await call_reward(r, "\\boxed{4}", data, finish_reason="stop"),
                    await call_reward(r, "\\boxed{4}", data, finish_reason="length"),
                    await call_reward(r, "\\boxed{4}", data, finish_reason="abort"),
                    await call_reward(user_reward, "x", data, finish_reason="length"),
                    await call_reward(user_reward, "x", data)]

        got = asyncio.run(go())
        assert got == [1.0, 0.0, 0.0, 1.0, 1.0] and seen == ["length", None]
        assert "finish_reason" not in data, "the caller's data must not change"
        # a workflow that does not say how the answer ended cannot apply the rule: refused, not ignored
        with pytest.raises(KeyError, match="finish_reason"):
            r.grade("\\boxed{4}", data)
    finally:
        r.close()


# ------------------------------------------------------------------------------------------- held-out grading
def _eval_rows():
    return [{"query_id": "a0", "prompt": "Tom has 7 apples and buys 5 more.", "solutions": ["12"], "kind": "add1"},
            {"query_id": "a1", "prompt": "Mei has 2 coins and buys 3 more.", "solutions": ["5"], "kind": "add1"},
            {"query_id": "m0", "prompt": "Anna buys 2 bags of 3 books.", "solutions": ["6"], "kind": "mul1"},
            {"query_id": "m1", "prompt": "Omar buys 2 bags of 4 shells.", "solutions": ["8"], "kind": "mul1"}]


def test_math_accuracy_per_kind_eos_and_length(env, monkeypatch):
    """Scripted answers through math_accuracy (the tiny model's tokenizer and prompts): strict grading counts only
    stated answers that ended; the EOS rate, lengths and per-kind figures are those of the answers."""
    import realhf.impl.model.nn.generation as generation
    from realhf.experiments.math_eval import math_accuracy

    tok = env["tok"]
    script = [("5 + 7 = 12. The answer is 12.", True), ("so 5 apples and", False),  # right; unstated and cut
              ("2 * 3 = \\boxed{6}", False), ("\\boxed{9}", True)]  # right but cut; stated, wrong
    ids = [_answer_ids(tok, t, e) for t, e in script]
    batches = []

    def fake_generate(model, prompts, g, eos_token_id=None, **kw):
        assert g.greedy and g.max_new_tokens == 16 and eos_token_id == tok.eos_token_id
        first = sum(batches)
        batches.append(len(prompts))
        return generation.GenerationOutput(tokens=ids[first:first + len(prompts)], logprobs=[[0.0] * len(t) for t in
                                           ids[first:first + len(prompts)]],
                                           no_eos=[not e for _, e in script[first:first + len(prompts)]])

    monkeypatch.setattr(generation, "generate", fake_generate)
    rows = _eval_rows()
    strict = math_accuracy(env["model"], rows, max_new_tokens=16, batch_size=3, require_eos=True)
    assert batches == [3, 1]
    assert (strict.n, strict.n_correct, strict.eos_rate) == (4, 1, 0.5)
    assert strict.mean_answer_tokens == pytest.approx(sum(map(len, ids)) / 4)
    assert strict.per_kind["add1"] == {"n": 2, "n_correct": 1, "accuracy": 0.5, "eos_rate": 0.5,
                                       "mean_answer_tokens": pytest.approx((len(ids[0]) + len(ids[1])) / 2)}
    assert strict.per_kind["mul1"]["accuracy"] == 0.0 and strict.per_kind["mul1"]["eos_rate"] == 0.5
    assert [r["answer"] for r in strict.rows] == ["12", None, "6", "9"]
    assert [r["ended"] for r in strict.rows] == [True, False, False, True]
    # lenient (the old grading): the last number counts and a cut answer may count
    batches.clear()
    lenient = math_accuracy(env["model"], rows, max_new_tokens=16, allow_last_number=True)
    assert batches == [4] and [r["correct"] for r in lenient.rows] == [True, True, True, False]
    # a few examples for a summary: one per kind, or the same problems as another run's
    assert [r["query_id"] for r in strict.examples(3)] == ["a0", "m0", "a1"]
    assert [r["query_id"] for r in lenient.examples(query_ids=["m1", "a0"])] == ["m1", "a0"]
    s = strict.summary(n_examples=2)
    assert s["grading"] == {"require_eos": True, "allow_last_number": False} and len(s["examples"]) == 2
    json.dumps(s)


def test_math_accuracy_on_a_tiny_model(env):
    """A real greedy run (random tiny weights): the bookkeeping agrees with the answers it reports."""
    from realhf.experiments.math_eval import math_accuracy

    rows = _eval_rows()
    res = math_accuracy(env["model"], rows, max_new_tokens=6, require_eos=True, batch_size=3, threads=1)
    assert res.n == 4 and set(res.per_kind) == {"add1", "mul1"}
    assert res.eos_rate == pytest.approx(sum(r["ended"] for r in res.rows) / 4)
    assert all(r["answer_tokens"] <= 6 and (r["ended"] or r["answer_tokens"] == 6) for r in res.rows)
    assert all(not r["correct"] or r["ended"] for r in res.rows)
    assert sum(k["n"] for k in res.per_kind.values()) == 4
    assert res.mean_answer_tokens == pytest.approx(sum(r["answer_tokens"] for r in res.rows) / 4)
