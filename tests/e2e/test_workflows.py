"""Rollout workflows (realhf.api.core.workflow_api, realhf.impl.workflow).

Checked here: a Trajectory becomes exactly the sample a synchronous actor_gen builds for the same tokens (keys,
shapes, dtypes, log-prob alignment) plus rewards; malformed answers are refused with what is wrong; the workflow
registry (names, import paths, bad paths, classes that are not workflows); the math reward (right, wrong,
unstated, lenient last number, graded off the event loop) and user rewards by import path; the bookkeeping of
rlvr and multi_turn against a scripted engine (masks, log-probs, versions, rewards, feedback tokens, turn
discount); and one rlvr episode on a real generation server through a real RolloutEngine, whose log-probs the
server's own /logprobs confirms.
"""
import asyncio
import threading

import pytest
import torch

from realhf.api.core.workflow_api import (AnswerSample, RolloutWorkflow, Trajectory, episode_data, make_workflow,
                                          register_workflow, registered_workflows)
from realhf.gen_server.api import GenerateResult, SampleOutput
from realhf.impl.workflow import MathReward, MultiTurnWorkflow, RLVRWorkflow, call_reward, load_reward_fn

EOS = 2  # the tiny tokenizer's eos (<|im_end|>)


@pytest.fixture(scope="module")
def tiny():
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tok(tiny):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """An in-process stand-in for RolloutEngine: ``script(input_ids, sampling)`` gives the outputs of each call."""

    def __init__(self, tokenizer, script, version=0):
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.calls = []

    async def agenerate(self, input_ids, sampling, rid, prefer=None):
        self.calls.append((list(input_ids), sampling, rid))
        outs = self.script(list(input_ids), sampling)
        assert len(outs) == sampling.n
        return GenerateResult(rid=rid, outputs=outs)


def out(ids, lp0=-0.5, version=3, reason="stop"):
    return SampleOutput(list(ids), [lp0 - 0.01 * i for i in range(len(ids))], [version] * len(ids), reason)


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------- Trajectory
def test_to_sample_equals_what_actor_gen_builds(tok):
    """The same prompt and answers through GenerationInterface (a synchronous run's actor_gen, with server
    versions) and through rlvr + Trajectory.to_sample give the same tensors under the same keys."""
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import GenerationHyperparameters, Model
    from realhf.impl.model.interface.gen_interface import GenerationInterface
    from realhf.impl.model.nn.generation import GenerationOutput

    prompt = [5, 17, 33, 9]
    answers = [enc(tok, "so \\boxed{4}") + [EOS], enc(tok, "maybe 5 or 6")]  # the second hit max_new_tokens
    outs = [out(answers[0], -0.3, 7), out(answers[1], -1.1, 6, "length")]
    outs[1].versions[-2:] = [7, 7]  # a weight update landed while it was generated

    class FakeGenEngine:
        def generate(self, prompts, gconfig, eos_token_id=None, seeds=None):
            assert prompts == [prompt] and gconfig.n == 2
            return GenerationOutput(tokens=[o.output_ids for o in outs], logprobs=[o.logprobs for o in outs],
                                    no_eos=[o.finish_reason != "stop" for o in outs],
                                    versions=[o.versions for o in outs])

    data = SequenceSample(keys={"packed_prompts"}, ids=["q0"], seqlens={"packed_prompts": [[len(prompt)]]},
                          trailing_shapes={"packed_prompts": ()}, dtypes={"packed_prompts": torch.long},
                          data={"packed_prompts": torch.tensor(prompt)})
    ref = GenerationInterface(GenerationHyperparameters(n=2, max_new_tokens=8)).generate(
        Model("actor", FakeGenEngine(), tok, None, ""), data, MicroBatchSpec())

    wf = RLVRWorkflow(lambda text, d: 1.0 if "boxed" in text else 0.0, {"n": 2, "max_new_tokens": 8}, tok)
    traj = run(wf.arun_episode(ScriptedEngine(tok, lambda ids, sp: outs), {"query_id": "q0", "input_ids": prompt}))
    s = traj.to_sample("b0s0")
    assert s.ids == ["b0s0"] and s.metadata == {"query_id": ["q0"]}
    assert s.keys == ref.keys | {"rewards"}
    for k in ref.keys:
        assert s.seqlens[k] == ref.seqlens[k], k
        assert s.dtypes[k] == ref.dtypes[k] and s.trailing_shapes[k] == ref.trailing_shapes[k], k
        assert torch.equal(s.data[k], ref.data[k]), k
    assert s.seqlens["rewards"] == [[1, 1]] and s.dtypes["rewards"] == torch.float32
    assert s.data["rewards"].tolist() == [1.0, 0.0]
    # alignment spelled out: entry t is the log-prob of token t+1
    P = len(prompt)
    lp = s.data["packed_logprobs"][: P + len(answers[0])].tolist()
    assert lp[: P - 1] == [0.0] * (P - 1) and lp[-1] == 0.0
    assert lp[P - 1 : -1] == pytest.approx(outs[0].logprobs)
    assert traj.min_version() == 6 and traj.max_version() == 7 and not traj.rewards_all_equal()
    # it travels on the wire (plain-JSON metadata)
    from realhf.api.core.data_api import SequenceSample as SS

    back = SS.from_wire(*s.to_wire())
    assert torch.equal(back.data["packed_versions"], s.data["packed_versions"])


def test_answer_sample_and_trajectory_refuse_malformed_data():
    ok = dict(input_ids=[1, 2, 3], prompt_mask=[True, True, False], logprobs=[0.0, -0.5, 0.0], versions=[-1, -1, 0],
              no_eos=False, reward=1.0)
    AnswerSample(**ok)
    cases = [
        (dict(logprobs=[0.0, -0.5]), "logprobs has 2 entries but input_ids has 3"),
        (dict(prompt_mask=[False, True, False]), "first token cannot be generated"),
        (dict(versions=[0, -1, 0]), "versions[0] = 0 on a non-generated token"),
        (dict(versions=[-1, -1, -1]), "versions[2] = -1 on a generated token"),
        (dict(logprobs=[-0.2, -0.5, 0.0]), "logprobs[0] = -0.2 but token 1 is not generated"),
        (dict(logprobs=[0.0, -0.5, -0.1]), "logprobs[2] = -0.1 but token 3 is past the end"),
        (dict(logprobs=[0.0, float("nan"), 0.0]), "not a finite log-probability"),
        (dict(reward=float("inf")), "reward must be a finite number"),
        (dict(input_ids=[], prompt_mask=[], logprobs=[], versions=[]), "input_ids is empty"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            AnswerSample(**{**ok, **bad})
    with pytest.raises(ValueError, match="has no samples"):
        Trajectory("q", [])
    with pytest.raises(ValueError, match="query_id must be a str"):
        Trajectory(3, [AnswerSample(**ok)])
    t = Trajectory("q", [AnswerSample(**ok), AnswerSample(**ok)])
    assert t.rewards_all_equal() and t.min_version() == t.max_version() == 0


# ------------------------------------------------------------------------------------------- registry
class EchoWorkflow(RolloutWorkflow):
    def __init__(self, tag="x"):
        self.tag = tag

    async def arun_episode(self, engine, data):
        return None


class NotAWorkflow:
    pass


def test_registry_names_import_paths_and_errors(tok):
    assert {"rlvr", "multi_turn"} <= set(registered_workflows())
    g = {"n": 2, "max_new_tokens": 4}
    assert isinstance(make_workflow("rlvr", reward_fn=None, gconfig=g, tokenizer=tok), RLVRWorkflow)
    wf = make_workflow("realhf.impl.workflow.multi_turn:MultiTurnWorkflow", reward_fn=None, gconfig=g, tokenizer=tok,
                       max_turns=3)
    assert isinstance(wf, MultiTurnWorkflow) and wf.max_turns == 3
    assert make_workflow(f"{__name__}:EchoWorkflow", tag="y").tag == "y"
    with pytest.raises(ValueError, match=r"unknown workflow 'rlfv'; registered: \[.*'multi_turn', 'rlvr'"):
        make_workflow("rlfv")
    with pytest.raises(ImportError, match="'no_such_pkg.mod:W'.*cannot import module 'no_such_pkg.mod'.*"
                                          "ModuleNotFoundError"):
        make_workflow("no_such_pkg.mod:W")
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        make_workflow("realhf.impl.workflow.rlvr:Nope")
    with pytest.raises(TypeError, match="not a subclass of .*RolloutWorkflow"):
        make_workflow(f"{__name__}:NotAWorkflow")
    with pytest.raises(TypeError, match="not a subclass of RolloutWorkflow"):
        register_workflow("bad", NotAWorkflow)
    with pytest.raises(ValueError, match="import path"):
        make_workflow("a:b:c")
    with pytest.raises(TypeError, match=r"workflow 'rlvr' .* cannot be built with arguments \['gconfig', 'max_turns'"):
        make_workflow("rlvr", reward_fn=None, gconfig=g, tokenizer=tok, max_turns=2)
    with pytest.raises(ValueError, match=r"gconfig has unknown keys \['n_samples'\]"):
        make_workflow("rlvr", reward_fn=None, gconfig={"n_samples": 2}, tokenizer=tok)


# ------------------------------------------------------------------------------------------- rewards
def sync_reward(text, data):
    return float(len(text)) + (0.5 if threading.current_thread() is threading.main_thread() else 0.0)


class ScaledReward:
    def __init__(self, scale=1.0):
        self.scale = scale

    async def __call__(self, text, data):
        return self.scale * len(text)


def test_math_reward_right_wrong_unstated_and_off_the_loop():
    data = {"query_id": "q", "solutions": ["4"]}
    threads = []

    class Watched(MathReward):
        def grade(self, text, d):
            threads.append(threading.current_thread())
            return super().grade(text, d)

    r, lenient = Watched(), MathReward(correct_reward=1.0, wrong_reward=0.0, allow_last_number=True)

    async def go():
        return await asyncio.gather(r("2+2 = \\boxed{4}", data), r("it is \\boxed{5}", data), r("no idea", data),
                                    r("so 4", data), lenient("so 4", data), lenient("so 5", data),
                                    r("The answer is 4.", data))

    try:
        assert run(go()) == [5.0, -5.0, -5.0, -5.0, 1.0, 0.0, 5.0]
        assert threads and all(t is not threading.main_thread() for t in threads), "graded on the event loop"
        assert r.stats["total"] == 5
    finally:
        r.close()
        lenient.close()
    with pytest.raises(KeyError, match="solutions"):
        MathReward().grade("\\boxed{1}", {"query_id": "q"})


def test_user_rewards_by_import_path():
    f = load_reward_fn(f"{__name__}:sync_reward", correct_reward=1.0)
    assert run(call_reward(f, "abc", {})) == 3.0, "a synchronous reward must run in a thread, off the loop"
    c = load_reward_fn(f"{__name__}:ScaledReward", scale=2.0, wrong_reward=-1.0)  # options it does not take: dropped
    assert isinstance(c, ScaledReward) and c.scale == 2.0 and run(call_reward(c, "abcd", {})) == 8.0
    d = load_reward_fn(None, correct_reward=2.0, wrong_reward=-2.0, timeout_secs=3.0, allow_last_number=True)
    assert isinstance(d, MathReward) and (d.correct_reward, d.timeout_secs, d.allow_last_number) == (2.0, 3.0, True)
    with pytest.raises(ImportError, match="no_such_module"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(TypeError, match="not callable"):
        load_reward_fn(f"{__name__}:EOS")
    with pytest.raises(ValueError, match="returned nan"):
        run(call_reward(lambda t, d: float("nan"), "x", {}))


# ------------------------------------------------------------------------------------------- rlvr
def test_rlvr_bookkeeping_on_a_scripted_engine(tok):
    prompt = [1, 459, 201, 51, 2, 201, 1, 472, 201]
    right, wrong = enc(tok, "so \\boxed{4}") + [EOS], enc(tok, "\\boxed{5} maybe")
    eng = ScriptedEngine(tok, lambda ids, sp: [out(right, -0.2, 4), out(wrong, -0.7, 5, "length"),
                                                out(right, -0.4, 5)])
    g = {"n": 3, "max_new_tokens": len(wrong), "min_new_tokens": 1, "temperature": 0.7, "top_p": 0.9,
         "stop_token_ids": [7], "seed": 11, "compile_decode": True}
    wf = RLVRWorkflow(MathReward(), g, tok)
    data = {"query_id": "q7", "prompt": "2+2?", "input_ids": prompt, "solutions": ["4"], "task": "math"}
    traj = run(wf.arun_episode(eng, data))
    (ids, sp, rid), = eng.calls
    assert ids == prompt and sp.n == 3 and sp.max_new_tokens == len(wrong) and sp.min_new_tokens == 1
    assert sp.stop_token_ids == [7, EOS] and sp.temperature == 0.7 and sp.top_p == 0.9
    assert sp.seed is not None and rid.startswith("q7-")
    # another query (or version) draws other samples; the same one the same
    eng2 = ScriptedEngine(tok, eng.script)
    run(wf.arun_episode(eng2, {**data, "query_id": "q8"}))
    run(wf.arun_episode(eng2, data))
    assert eng2.calls[0][1].seed != sp.seed and eng2.calls[1][1].seed == sp.seed
    run(wf.arun_episode(eng2, {**data, "seed": 2**61 + 3}))  # the rollout worker's seed is used as it is
    assert eng2.calls[2][1].seed == 2**61 + 3
    assert traj.query_id == "q7" and traj.rewards() == [5.0, -5.0, 5.0]
    P = len(prompt)
    for s, o in zip(traj.samples, [right, wrong, right]):
        assert s.input_ids == prompt + o
        assert s.prompt_mask == [True] * P + [False] * len(o)
        assert s.versions[:P] == [-1] * P and len(set(s.versions[P:])) == 1
    assert traj.samples[1].logprobs[P - 1 : -1] == pytest.approx([-0.7 - 0.01 * i for i in range(len(wrong))])
    assert [s.no_eos for s in traj.samples] == [False, True, False]
    assert traj.min_version() == 4 and traj.max_version() == 5
    assert traj.stats["reward"] == pytest.approx(5.0 / 3) and traj.stats["no_eos_ratio"] == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------------------- multi_turn
def test_multi_turn_feedback_masks_and_turn_discount(tok):
    from realhf.impl.model.utils.functional import answer_loss_mask

    prompt = [1, 459, 201, 51, 2, 201, 1, 472, 201]
    right, wrong = enc(tok, "\\boxed{4}") + [EOS], enc(tok, "\\boxed{5}") + [EOS]
    long_wrong = enc(tok, "it is 5 or")  # cut at max_new_tokens: no stop token
    fb_text = "Wrong, again."

    def script(ids, sp):
        if ids == prompt:  # turn 1 of the group: right, wrong (stopped), wrong (cut)
            assert sp.n == 3
            return [out(right, -0.1, 1), out(wrong, -0.2, 1), out(long_wrong, -0.3, 1, "length")]
        assert sp.n == 1
        if ids[len(prompt):len(prompt) + len(wrong)] == wrong:  # sample 1 gets it right at turn 2
            return [out(right, -0.5, 2)]
        return [out(wrong, -0.9, 3)]  # sample 2 stays wrong

    eng = ScriptedEngine(tok, script)
    wf = MultiTurnWorkflow(MathReward(), {"n": 3, "max_new_tokens": 12, "seed": 1}, tok, max_turns=3,
                           turn_discount=0.5, feedback=fb_text)
    data = {"query_id": "m", "input_ids": prompt, "solutions": ["4"]}
    traj = run(wf.arun_episode(eng, data))
    s0, s1, s2 = traj.samples
    after_stop = tok.decode(wf.feedback.after(out(wrong)), skip_special_tokens=False)
    after_cut = tok.decode(wf.feedback.after(out(long_wrong, reason="length")), skip_special_tokens=False)
    assert after_stop == f"\n<|im_start|>user\n{fb_text}<|im_end|>\n<|im_start|>assistant\n"
    assert after_cut == "<|im_end|>" + after_stop
    fb_stop, fb_cut = wf.feedback.after(out(wrong)), wf.feedback.after(out(long_wrong, reason="length"))
    # sample 0: right at once; sample 1: wrong, feedback, right; sample 2: cut, feedback, wrong, feedback, wrong
    assert s0.input_ids == prompt + right and s0.reward == 5.0
    assert s1.input_ids == prompt + wrong + fb_stop + right and s1.reward == 2.5
    assert s2.input_ids == prompt + long_wrong + fb_cut + wrong + fb_stop + wrong and s2.reward == -5.0
    P = len(prompt)
    a, f = P + len(wrong), P + len(wrong) + len(fb_stop)
    assert s1.prompt_mask == [True] * P + [False] * len(wrong) + [True] * len(fb_stop) + [False] * len(right)
    assert s1.versions == [-1] * P + [1] * len(wrong) + [-1] * len(fb_stop) + [2] * len(right)
    # log-prob t is that of token t+1: the answer's own, 0 before and on the feedback, then the second answer's
    assert s1.logprobs[P - 1 : a - 1] == pytest.approx([-0.2 - 0.01 * i for i in range(len(wrong))])
    assert s1.logprobs[a - 1 : f - 1] == [0.0] * len(fb_stop)
    assert s1.logprobs[f - 1 : -1] == pytest.approx([-0.5 - 0.01 * i for i in range(len(right))])
    assert s1.logprobs[-1] == 0.0
    # the trainer's loss mask leaves the feedback out
    sample = traj.to_sample("x")
    mask = answer_loss_mask(sample.data["prompt_mask"], sample.cu_seqlens("packed_input_ids"))
    off = len(s0.input_ids)
    m1 = mask[off : off + len(s1.input_ids)].tolist()
    assert [i for i, x in enumerate(m1) if x] == list(range(P - 1, a - 1)) + list(range(f - 1, len(s1.input_ids) - 1))
    assert traj.stats["turns"] == pytest.approx((1 + 2 + 3) / 3) and traj.stats["success"] == pytest.approx(2 / 3)
    assert [s.no_eos for s in traj.samples] == [False, False, False]
    # the later turns' requests: one sample each, the whole sequence so far as their prompt
    assert all(c[1].n == 1 for c in eng.calls[1:]) and len(eng.calls) == 4
    assert sorted(len(c[0]) for c in eng.calls[1:]) == sorted(
        [f, P + len(long_wrong) + len(fb_cut), P + len(long_wrong) + len(fb_cut) + len(wrong) + len(fb_stop)])
    assert len({c[1].seed for c in eng.calls}) == 4, "every turn of every sample draws from its own stream"

    # without a chat template: the plain text on a line of its own; one turn only: the wrong reward
    wf2 = MultiTurnWorkflow(MathReward(), {"n": 1, "max_new_tokens": 12}, tok, max_turns=1, use_chat_template=False)
    assert tok.decode(wf2.feedback.after(out(wrong))) == "\nYour answer is wrong. Try again.\n"
    t2 = run(wf2.arun_episode(ScriptedEngine(tok, lambda ids, sp: [out(wrong)]), data))
    assert t2.samples[0].reward == -5.0 and t2.stats["turns"] == 1
    with pytest.raises(ValueError, match="max_seq_len=10 leaves no room"):
        MultiTurnWorkflow(None, {"max_new_tokens": 12}, tok, max_seq_len=10)


# ------------------------------------------------------------------------------------------- a real server
def test_rlvr_episode_on_a_real_server(tiny, tok, tmp_path):
    from realhf.gen_server.client import GenClient
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.dataset.math import MathPromptDataset, write_math_jsonl
    from realhf.system.rollout.engine import RolloutEngine

    write_math_jsonl([{"query_id": "a1", "prompt": "What is 2+2?", "solutions": ["4"]}], str(tmp_path / "m.jsonl"))
    ds = MathPromptDataset(str(tmp_path / "m.jsonl"), tok, max_prompt_len=256)
    data = episode_data(ds, 0)
    assert data["query_id"] == "a1" and data["prompt"] == "What is 2+2?" and data["solutions"] == ["4"]
    assert data["input_ids"] == ds[0]["prompt_ids"] and data["task"] == "math"
    wf = make_workflow("rlvr", reward_fn="realhf.impl.workflow.rewards:MathReward",
                       gconfig={"n": 3, "max_new_tokens": 10, "seed": 5}, tokenizer=tok)

    async def go(fleet):
        client = GenClient(fleet.addresses, fleet.secret)
        try:
            eng = RolloutEngine(client, tok)
            traj = await wf.arun_episode(eng, data)
            seqs = [s.input_ids for s in traj.samples]
            return traj, await client.logprobs(seqs)
        finally:
            await client.close()

    with LocalFleet("gen", tiny, 1) as fleet:
        traj, server_lp = run(go(fleet))
    P = len(data["input_ids"])
    assert traj.query_id == "a1" and traj.n == 3
    for s, lp in zip(traj.samples, server_lp):
        assert s.input_ids[:P] == data["input_ids"] and 1 <= s.n_generated <= 10
        assert s.no_eos == (s.input_ids[-1] != EOS) and (s.no_eos <= (s.n_generated == 10))
        gen = [t for t in range(len(s.input_ids) - 1) if not s.prompt_mask[t + 1]]
        assert max(abs(s.logprobs[t] - lp[t]) for t in gen) < 1e-4, "log-prob t is not that of token t+1"
        assert all(v == 0 for v, pm in zip(s.versions, s.prompt_mask) if not pm)
        assert s.reward in (5.0, -5.0)
    sample = traj.to_sample("b0s0")
    assert sample.seqlens["packed_input_ids"] == [[len(s.input_ids) for s in traj.samples]]
