"""The gen backend's engine (realhf/gen_server/realhf_engine.py): continuous batching over a real tiny model.

Every result is compared with the in-process batched ``generate`` (greedy tokens and log-probs, seeded
samples) or with the engine's own state (versions, finish reasons, metrics). Weight updates are tested in
test_gen_engine_weights.py.
"""
import asyncio

import pytest
import torch

from realhf.gen_server.api import EngineConfig, RequestError

from support.gen_engine_util import _engine, _gen, _max_err, _prompts, _req, _until
from support.gen_engine_util import path_fixture, ref_model_fixture  # noqa: F401 - the fixtures `path` and `ref_model`


# --------------------------------------------------------------------------- sampling equals generate()


def test_greedy_concurrent_requests_equal_generate(path, ref_model):
    prompts = _prompts()
    probe = _gen(ref_model, prompts, greedy=True, max_new_tokens=24)
    stop = probe.tokens[1][4]  # a token the model emits: some prompts stop early, others run to the limit
    ref = _gen(ref_model, prompts, greedy=True, max_new_tokens=24, stop_token_ids=[stop])
    assert any(ref.no_eos) and not all(ref.no_eos)

    async def main():
        e = _engine(path)
        await e.start()
        try:
            return await asyncio.gather(*[
                e.generate(_req(f"r{i}", p, greedy=True, max_new_tokens=24, stop_token_ids=[stop]))
                for i, p in enumerate(prompts)]), e.metrics()
        finally:
            await e.close()

    res, m = asyncio.run(main())
    for i, r in enumerate(res):
        assert r.rid == f"r{i}" and len(r.outputs) == 1
        o = r.outputs[0]
        assert o.output_ids == ref.tokens[i], f"prompt {i}: greedy tokens differ from generate()"
        assert _max_err(o.logprobs, ref.logprobs[i]) < 1e-5
        assert o.finish_reason == ("length" if ref.no_eos[i] else "stop")
        assert o.versions == [0] * len(o.output_ids)
    assert m["generated_tokens"] == sum(len(t) for t in ref.tokens)
    assert m["running_requests"] == m["waiting_requests"] == m["tokens_in_flight"] == 0


def test_seeded_samples_equal_generate_whatever_runs_beside(path, ref_model):
    """Seeded requests (n=3; plain temperature sampling, and top-p/top-k) give generate(seeds=...)'s samples
    while unseeded, greedy and long requests share their batch, and join it mid-flight."""
    prompts = _prompts(lens=[5, 9, 4, 7])
    cases = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.8, top_k=30), dict(temperature=1.3, top_k=5)]

    async def main():
        e = _engine(path)
        await e.start()
        try:
            noise = [asyncio.create_task(e.generate(_req("long", prompts[0], temperature=1.0, max_new_tokens=200))),
                     asyncio.create_task(e.generate(_req("greedy", prompts[1], greedy=True, max_new_tokens=60)))]
            await _until(lambda: e.metrics()["generated_tokens"] > 5, "the first requests to run")
            seeded = [asyncio.create_task(e.generate(_req(f"s{c}-{i}", p, n=3, seed=100 * c + i, max_new_tokens=20,
                                                          **kw)))
                      for c, kw in enumerate(cases) for i, p in enumerate(prompts)]
            out = await asyncio.gather(*seeded)
            assert not noise[0].done(), "the long request should still be running"
            await asyncio.gather(*noise)
            return out
        finally:
            await e.close()

    res = asyncio.run(main())
    k = 0
    for c, kw in enumerate(cases):
        for i, p in enumerate(prompts):
            r = res[k]
            k += 1
            ref = _gen(ref_model, [p], seeds=[100 * c + i], n=3, max_new_tokens=20, **kw)
            got = [o.output_ids for o in r.outputs]
            assert got == ref.tokens, f"case {kw} prompt {i}: samples differ from generate(seeds=...)"
            assert len({tuple(t) for t in got}) > 1, "the samples of one request should differ"
            for o, lps in zip(r.outputs, ref.logprobs):
                assert _max_err(o.logprobs, lps) < 1e-5


# --------------------------------------------------------------------------- continuous batching


def test_request_joins_running_batch(path, ref_model):
    long_p, short_p = _prompts(lens=[6, 9], seed=3)
    ref_long = _gen(ref_model, [long_p], greedy=True, max_new_tokens=300).tokens[0]
    ref_short = _gen(ref_model, [short_p], greedy=True, max_new_tokens=40).tokens[0]

    async def main():
        e = _engine(path)
        await e.start()
        try:
            long_t = asyncio.create_task(e.generate(_req("long", long_p, greedy=True, max_new_tokens=300)))
            await _until(lambda: e.metrics()["generated_tokens"] > 0, "the long request to start")
            short_t = asyncio.create_task(e.generate(_req("short", short_p, greedy=True, max_new_tokens=40)))
            most = 0
            while not short_t.done():
                most = max(most, e.metrics()["running_requests"])
                await asyncio.sleep(0.001)
            long_running = not long_t.done()
            return await long_t, await short_t, most, long_running
        finally:
            await e.close()

    long_r, short_r, most, long_running = asyncio.run(main())
    assert long_running, "the short request should finish while the long one still runs"
    assert most == 2, "both requests should have run in one batch"
    assert short_r.outputs[0].output_ids == ref_short
    assert long_r.outputs[0].output_ids == ref_long
    assert [o.finish_reason for o in (long_r.outputs[0], short_r.outputs[0])] == ["length", "length"]


def test_max_num_seqs_bounds_the_batch(path, ref_model):
    prompts = _prompts()

    async def main():
        e = _engine(path, max_num_seqs=4)
        await e.start()
        try:
            res = await asyncio.gather(*[e.generate(_req(f"r{i}", p, n=2, greedy=True, max_new_tokens=12))
                                         for i, p in enumerate(prompts)])
            return res, e.metrics()
        finally:
            await e.close()

    res, m = asyncio.run(main())
    ref = _gen(ref_model, prompts, greedy=True, max_new_tokens=12)
    for r, t in zip(res, ref.tokens):
        assert [o.output_ids for o in r.outputs] == [t, t]
    assert 2 <= m["max_batch_size"] <= 4


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-graph-step"])
def test_staggered_mixed_requests_equal_generate(path, ref_model, graphs):
    """Requests of mixed lengths, n, limits and stop tokens arrive while others run, through a batch of at
    most 6 rows: rows leave (moving other rows into their slots) and join (growing the cache) at many steps,
    and every request still gets exactly what generate gives it alone.

    ``padded-graph-step``: the decode step CUDA's engine replays as a graph (``PaddedGraphDecoder``, the batch padded
    to 1, 2, 4 or 8 rows over the slot storage), here with ``capture=False``: each "replay" re-runs the static step
    on the buffers a graph would be captured on, which checks the padding and the buffers kept per row count."""
    g = torch.Generator().manual_seed(21)
    specs = []
    for i in range(14):
        p = torch.randint(3, 1000, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(1, 4, (1,), generator=g))
        kw = dict(max_new_tokens=int(torch.randint(1, 12 + 15 * i, (1,), generator=g)))
        if i % 3 == 0:
            kw.update(greedy=True)
        else:
            kw.update(temperature=[0.7, 1.0][i % 2], top_k=[0, 40][(i // 2) % 2])
        stop = torch.randint(3, 1000, (40,), generator=g).tolist()  # stops at various steps
        specs.append((p, n, kw, stop, None if kw.get("greedy") else 1000 + i))

    async def main():
        e = _engine(path, max_num_seqs=6, extra={"share_prefixes": False} if graphs else None)
        await e.start()
        if graphs:
            from realhf.impl.model.nn.graph_decode import GraphDecoder, PaddedGraphDecoder

            e._decoder = PaddedGraphDecoder(GraphDecoder(e.model, capture=False))  # before any request: the engine thread is idle
        try:
            tasks = []
            for i, (p, n, kw, stop, seed) in enumerate(specs):
                tasks.append(asyncio.create_task(
                    e.generate(_req(f"r{i}", p, n=n, stop_token_ids=stop, seed=seed, **kw))))
                target = e.metrics()["generated_tokens"] + 3
                await _until(lambda: e.metrics()["generated_tokens"] >= target or all(t.done() for t in tasks),
                             "progress")
            return await asyncio.gather(*tasks), e.metrics(), e._decoder
        finally:
            await e.close()

    res, m, dec = asyncio.run(main())
    assert m["max_batch_size"] <= 6 and m["prefills"] > 3
    if graphs:
        # every step ran on the padded step; an entry per (storage, padded row count), not per batch size: the
        # storage grows to 6 rows (padded counts 1, 2, 4, 6) and a few times in positions
        assert dec.replays + dec.captures == m["steps"], (dec.replays, dec.captures, m["steps"])
        assert dec.padded_steps > 0 and dec.captures <= 4 * 4, dec.captures
        assert dec.replays > 5 * dec.captures
    for i, ((p, n, kw, stop, seed), r) in enumerate(zip(specs, res)):
        ref = _gen(ref_model, [p], seeds=None if seed is None else [seed], n=n, stop_token_ids=stop, **kw)
        assert [o.output_ids for o in r.outputs] == ref.tokens, f"request {i} ({kw}) differs from generate()"
        for o, lps, ne in zip(r.outputs, ref.logprobs, ref.no_eos):
            assert _max_err(o.logprobs, lps) < 1e-5
            assert o.finish_reason == ("length" if ne else "stop")
    reasons = {o.finish_reason for r in res for o in r.outputs}
    assert reasons == {"stop", "length"}


def test_running_rows_survive_cache_growth(path, ref_model):
    """A request that needs more rows and positions than the running batch's cache holds joins while another
    runs (made certain by pausing): the cache grows under the running row, which goes on unchanged."""
    pa, pb = _prompts(lens=[5, 30], seed=13)

    async def main():
        e = _engine(path)
        await e.start()
        try:
            ta = asyncio.create_task(e.generate(_req("a", pa, greedy=True, max_new_tokens=150)))
            await _until(lambda: e.metrics()["generated_tokens"] > 2, "request a to run")
            await e.pause()
            tb = asyncio.create_task(e.generate(_req("b", pb, n=12, seed=4, temperature=1.0, max_new_tokens=200)))
            await _until(lambda: e.metrics()["waiting_requests"] == 1, "request b to be queued")
            before = e.metrics()["prefills"]
            await e.resume()
            await _until(lambda: e.metrics()["prefills"] > before, "request b to be admitted")
            m = e.metrics()
            return await ta, await tb, m
        finally:
            await e.close()

    ra, rb, m = asyncio.run(main())
    assert m["running_requests"] == 2 or ra.outputs[0].finish_reason == "length"
    ref_a = _gen(ref_model, [pa], greedy=True, max_new_tokens=150)
    assert ra.outputs[0].output_ids == ref_a.tokens[0]
    assert _max_err(ra.outputs[0].logprobs, ref_a.logprobs[0]) < 1e-5
    ref = _gen(ref_model, [pb], seeds=[4], n=12, temperature=1.0, max_new_tokens=200)
    assert [o.output_ids for o in rb.outputs] == ref.tokens
    for o, lps in zip(rb.outputs, ref.logprobs):
        assert _max_err(o.logprobs, lps) < 1e-5


@pytest.mark.slow  # compiling the decode step costs about 30 s on 2 cores
def test_compiled_decode_equals_generate(path, ref_model):
    prompts = _prompts()

    async def main():
        e = _engine(path, extra={"compile_decode": True})
        await e.start()
        try:
            greedy = await asyncio.gather(*[e.generate(_req(f"g{i}", p, greedy=True, max_new_tokens=16))
                                            for i, p in enumerate(prompts)])
            seeded = await asyncio.gather(*[e.generate(_req(f"s{i}", p, n=2, seed=i, top_k=30, max_new_tokens=16))
                                            for i, p in enumerate(prompts)])
            return greedy, seeded
        finally:
            await e.close()

    greedy, seeded = asyncio.run(main())
    ref = _gen(ref_model, prompts, greedy=True, max_new_tokens=16)
    for r, t, lps in zip(greedy, ref.tokens, ref.logprobs):
        assert r.outputs[0].output_ids == t and _max_err(r.outputs[0].logprobs, lps) < 1e-4
    for i, (p, r) in enumerate(zip(prompts, seeded)):
        assert [o.output_ids for o in r.outputs] == _gen(ref_model, [p], seeds=[i], n=2, top_k=30,
                                                         max_new_tokens=16).tokens


# --------------------------------------------------------------------------- finish reasons


@pytest.mark.parametrize("share", [True, False], ids=["shared-kv", "slot-kv"])
def test_fp16_kv_cache_equals_generate_with_one(path, ref_model, share):
    """Backend option kv_cache_dtype="float16": the server's caches hold fp16, and its seeded samples equal in-process
    generate() with the same option (tokens exactly, log-probs to rounding), over the slot and shared-prompt caches."""
    prompts = _prompts(lens=[5, 9, 4])

    async def main():
        e = _engine(path, extra={"kv_cache_dtype": "float16", "share_prefixes": share})
        await e.start()
        try:
            out = await asyncio.gather(*[e.generate(_req(f"r{i}", p, n=2, seed=10 + i, max_new_tokens=16,
                                                         temperature=0.9)) for i, p in enumerate(prompts)])
            return out, e._cache.k[0].dtype
        finally:
            await e.close()

    res, dtype = asyncio.run(main())
    assert dtype == torch.float16
    for i, (r, p) in enumerate(zip(res, prompts)):
        ref = _gen(ref_model, [p], seeds=[10 + i], n=2, max_new_tokens=16, temperature=0.9, kv_cache_dtype="float16")
        assert [o.output_ids for o in r.outputs] == ref.tokens, f"prompt {i}: samples differ from generate()"
        for o, lps in zip(r.outputs, ref.logprobs):
            # the server decodes all rows together, generate() each prompt's two: on a CPU without the tile kernel
            # (no AVX-512) BLAS rounds products of other row counts otherwise, by up to ~2e-6 of logits near 7
            assert _max_err(o.logprobs, lps) < 3e-5
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16, got 'fp8'"):
        _engine(path, extra={"kv_cache_dtype": "fp8"})


def test_stop_min_new_tokens_and_length(path, ref_model):
    # a prompt whose greedy continuation emits a new token at some step k >= 2 (the tiny model likes repeating)
    for seed in range(100):
        p = _prompts(lens=[7], seed=seed)[0]
        free = _gen(ref_model, [p], greedy=True, max_new_tokens=20).tokens[0]
        k = next((i for i in range(2, 14) if free[i] not in free[:i]), None)
        if k is not None:
            break
    stop = free[k]
    ref_min = _gen(ref_model, [p], greedy=True, max_new_tokens=20, stop_token_ids=[stop], min_new_tokens=k + 1)
    sampled = dict(temperature=1.0, stop_token_ids=[stop, free[0]], min_new_tokens=6, max_new_tokens=20)
    ref_s = _gen(ref_model, [p], seeds=[5], n=4, **sampled)

    async def main():
        e = _engine(path)
        await e.start()
        try:
            return await asyncio.gather(
                e.generate(_req("stop", p, greedy=True, max_new_tokens=20, stop_token_ids=[stop])),
                e.generate(_req("min", p, greedy=True, max_new_tokens=20, stop_token_ids=[stop], min_new_tokens=k + 1)),
                e.generate(_req("len", p, greedy=True, max_new_tokens=5)),
                e.generate(_req("one", p, greedy=True, max_new_tokens=1, stop_token_ids=[stop])),
                e.generate(_req("first", p, greedy=True, max_new_tokens=9, stop_token_ids=[free[0]])),
                e.generate(_req("sampled", p, n=4, seed=5, **sampled)))
        finally:
            await e.close()

    r_stop, r_min, r_len, r_one, r_first, r_s = [r.outputs for r in asyncio.run(main())]
    assert r_stop[0].output_ids == free[:k + 1] and r_stop[0].finish_reason == "stop"
    assert r_min[0].output_ids == ref_min.tokens[0] and r_min[0].output_ids[:k] == free[:k]
    assert r_min[0].output_ids[k] != stop, "the stop token must be banned before min_new_tokens"
    # the banned step's log-prob is that of the unmodified distribution, as generate reports it
    assert _max_err(r_min[0].logprobs, ref_min.logprobs[0]) < 1e-5
    assert r_min[0].finish_reason == ("length" if ref_min.no_eos[0] else "stop")
    assert r_len[0].output_ids == free[:5] and r_len[0].finish_reason == "length"
    assert r_one[0].output_ids == free[:1] and r_one[0].finish_reason == "length"
    assert r_first[0].output_ids == free[:1] and r_first[0].finish_reason == "stop"
    assert [o.output_ids for o in r_s] == ref_s.tokens
    for o, ne in zip(r_s, ref_s.no_eos):
        assert len(o.output_ids) >= 6 and o.finish_reason == ("length" if ne else "stop")
        assert (o.output_ids[-1] in (stop, free[0])) == (o.finish_reason == "stop")


# --------------------------------------------------------------------------- abort, pause, close


def test_pause_resume_abort(path, ref_model):
    pa, pb = _prompts(lens=[6, 8], seed=5)
    ref_a = _gen(ref_model, [pa], greedy=True, max_new_tokens=400).tokens[0]
    ref_b = _gen(ref_model, [pb], greedy=True, max_new_tokens=30).tokens[0]

    async def main():
        e = _engine(path)
        await e.start()
        try:
            ta = asyncio.create_task(e.generate(_req("a", pa, greedy=True, max_new_tokens=400)))
            await _until(lambda: e.metrics()["generated_tokens"] > 3, "request a to run")
            await e.pause()
            m1 = e.metrics()
            tb = asyncio.create_task(e.generate(_req("b", pb, greedy=True, max_new_tokens=30)))
            await _until(lambda: e.metrics()["waiting_requests"] == 1, "request b to be queued")
            await asyncio.sleep(0.3)
            m2 = e.metrics()
            assert m1["paused"] and m2["paused"]
            assert m2["generated_tokens"] == m1["generated_tokens"], "a paused engine made progress"
            assert (m2["running_requests"], m2["waiting_requests"]) == (1, 1) and m2["tokens_in_flight"] > 0
            assert not ta.done() and not tb.done()
            await e.resume()
            await _until(lambda: e.metrics()["generated_tokens"] > m2["generated_tokens"] + 5, "progress after resume")
            assert await e.abort(["a", "no-such-request"]) == 1
            ra = await ta
            rb = await tb
            # abort(None) also takes waiting requests
            await e.pause()
            tc = asyncio.create_task(e.generate(_req("c", pb, n=2, greedy=True, max_new_tokens=30)))
            await _until(lambda: e.metrics()["waiting_requests"] == 1, "request c to be queued")
            assert await e.abort() == 1
            rc = await tc
            await e.resume()
            rd = await e.generate(_req("a", pa, greedy=True, max_new_tokens=4))  # a rid may be reused
            return ra, rb, rc, rd, e.metrics()
        finally:
            await e.close()

    ra, rb, rc, rd, m = asyncio.run(main())
    a = ra.outputs[0]
    assert a.finish_reason == "abort" and 0 < len(a.output_ids) < 400
    assert a.output_ids == ref_a[:len(a.output_ids)], "an aborted request returns the tokens generated so far"
    assert len(a.logprobs) == len(a.versions) == len(a.output_ids)
    assert rb.outputs[0].output_ids == ref_b and rb.outputs[0].finish_reason == "length"
    assert [(o.output_ids, o.finish_reason) for o in rc.outputs] == [([], "abort")] * 2
    assert rd.outputs[0].output_ids == ref_a[:4]
    assert m["aborted_requests"] == 2 and m["running_requests"] == m["waiting_requests"] == 0


def test_resume_is_answered_before_the_prefill_it_lets_run(path):
    """Commands are answered as soon as the engine thread has run them: a resume after a weight update does not
    wait for the prefill of the requests that queued while the engine was paused. The prefill is held here until
    the resume has come back; answered at the end of the iteration instead, the resume would never come back."""
    import threading

    (pb,) = _prompts(lens=[6], seed=9)
    gate = threading.Event()

    async def main():
        e = _engine(path)
        await e.start()
        try:
            admit = e._admit

            def gated_admit():
                if e._waiting:
                    gate.wait(60)
                admit()

            e._admit = gated_admit
            await e.pause()
            tb = asyncio.create_task(e.generate(_req("b", pb, greedy=True, max_new_tokens=4)))
            await _until(lambda: e.metrics()["waiting_requests"] == 1, "request b to be queued")
            await asyncio.wait_for(e.resume(), timeout=30)
            assert not e.metrics()["paused"] and not tb.done()
            gate.set()
            return await tb
        finally:
            gate.set()
            await e.close()

    rb = asyncio.run(main())
    assert len(rb.outputs[0].output_ids) == 4


def test_close_fails_pending_requests(path):
    from realhf.gen_server.realhf_engine import EngineClosed

    async def main():
        e = _engine(path)
        await e.start()
        t = asyncio.create_task(e.generate(_req("a", [5, 6, 7], greedy=True, max_new_tokens=400)))
        await _until(lambda: e.metrics()["generated_tokens"] > 0, "request a to run")
        await e.pause()
        await e.close()
        with pytest.raises(EngineClosed, match="closed"):
            await t
        with pytest.raises(EngineClosed, match="closed"):
            await e.generate(_req("b", [5], greedy=True, max_new_tokens=2))

    asyncio.run(main())


# --------------------------------------------------------------------------- refused requests and configs


def test_bad_requests_and_configs(path):
    from realhf.gen_server.realhf_engine import RealhfEngine

    async def main():
        e = _engine(path, max_model_len=64, max_num_seqs=4)
        await e.start()
        try:
            cases = [
                (_req("long", [5] * 60, max_new_tokens=10), "70 exceeds max_model_len \\(64\\)"),
                (_req("oov", [5, 1008, 7], max_new_tokens=4), "token id 1008 at position 1.*vocabulary \\[0, 1008\\)"),
                (_req("neg", [-1, 5], max_new_tokens=4), "token id -1 at position 0"),
                (_req("stop", [5, 6], max_new_tokens=4, stop_token_ids=[99999]), "stop_token_ids.*99999"),
                (_req("n", [5, 6], n=5, max_new_tokens=4), "max_num_seqs"),
            ]
            for req, msg in cases:
                with pytest.raises(RequestError, match=msg):
                    await e.generate(req)
            with pytest.raises(RequestError, match="vocabulary"):
                await e.logprobs([[1, 2, 3], [4, 2000]])
            with pytest.raises(RequestError, match="at least 2"):
                await e.logprobs([[1]])
            # still serving
            r = await e.generate(_req("ok", [5, 6, 7], greedy=True, max_new_tokens=3))
            assert len(r.outputs[0].output_ids) == 3
        finally:
            await e.close()
        e2 = _engine(path)  # the model's own 512 positions bound the default max_model_len of 2048
        await e2.start()
        try:
            with pytest.raises(RequestError, match="the model's positions \\(512\\)"):
                await e2.generate(_req("long", [5] * 500, max_new_tokens=20))
        finally:
            await e2.close()
        with pytest.raises(ValueError, match="tp=1"):
            await _engine(path, tp_size=2).start()

    asyncio.run(main())
    with pytest.raises(ValueError, match="unknown options"):
        RealhfEngine(EngineConfig(backend="gen", model_path=path, extra={"compile": True}))


def test_engine_builds_and_runs_on_one_thread(path, monkeypatch):
    """The model is built on the engine's own thread, the thread that runs every decode step: one OpenMP
    team in the process (a build on another thread left a second team, and with more OpenMP threads than
    CPUs libgomp stops spin-waiting: decode steps measured 1.4x slower). A build that fails is raised by
    start() and leaves no thread behind."""
    import threading

    from realhf.gen_server import realhf_engine

    seen = {}
    real_build, real_step = realhf_engine.RealhfEngine._build, realhf_engine.RealhfEngine._decode_step

    def build(self, dtype):
        seen["build"] = threading.get_ident()
        return real_build(self, dtype)

    def step(self):
        seen.setdefault("steps", set()).add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(realhf_engine.RealhfEngine, "_build", build)
    monkeypatch.setattr(realhf_engine.RealhfEngine, "_decode_step", step)

    async def main():
        e = _engine(path)
        await e.start()
        try:
            await e.generate(_req("a", [5, 6, 7], greedy=True, max_new_tokens=4))
            return e._thread.ident
        finally:
            await e.close()

    engine_thread = asyncio.run(main())
    assert seen["build"] == engine_thread != threading.get_ident()
    assert seen["steps"] == {engine_thread}

    async def broken():
        e = _engine(path + "-missing")
        with pytest.raises(FileNotFoundError, match="config.json"):
            await e.start()
        assert e._thread is None
        await e.close()

    asyncio.run(broken())
