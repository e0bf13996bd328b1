"""The gen engine's weight updates (realhf/gen_server/realhf_engine.py), from a folder on disk and over a weight
group: log-probs after an update equal those of a fresh model built from the same folder, in-flight requests go
on across the update (their tokens carry the version that made them), an update that does not fit is refused
before anything changes, and one that breaks midway leaves nothing served until a complete set is loaded.
"""
import asyncio
import json
import multiprocessing as mp
import os
import shutil

import pytest

from realhf.gen_server.api import WeightGroupSpec

from support.gen_engine_util import (_bad_named, _build, _engine, _fresh_logprobs, _gen, _max_err, _named_hf,
                                     _prompts, _req, _until)
from support.gen_engine_util import path_fixture, perturbed_fixture, ref_model_fixture  # noqa: F401 - fixtures


def test_update_weights_from_disk(path, ref_model, perturbed, tmp_path):
    seqs = _prompts(lens=[9, 5, 12], seed=9)
    new_model = _build(perturbed)
    want = _fresh_logprobs(new_model, seqs)
    old = _fresh_logprobs(ref_model, seqs)
    assert max(_max_err(a, b) for a, b in zip(want, old)) > 1e-2, "the perturbation should change log-probs"
    p = seqs[0]
    ref_new = _gen(new_model, [p], greedy=True, max_new_tokens=20).tokens[0]
    # a folder of another architecture is refused before anything is loaded
    bad = str(tmp_path / "bad")
    shutil.copytree(perturbed, bad)
    with open(os.path.join(bad, "config.json")) as f:
        c = json.load(f)
    c["intermediate_size"] = 2 * c["intermediate_size"]
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(c, f)

    async def main():
        e = _engine(path)
        await e.start()
        try:
            with pytest.raises(ValueError, match="intermediate_dim"):
                await e.update_weights_from_disk(bad, 7)
            assert e.version == 0
            before = await e.logprobs(seqs)
            t = asyncio.create_task(e.generate(_req("inflight", p, greedy=True, max_new_tokens=400)))
            await _until(lambda: e.metrics()["generated_tokens"] > 3, "the in-flight request to run")
            await e.update_weights_from_disk(perturbed, 1)
            assert e.version == 1 and e.metrics()["version"] == 1
            after = await e.logprobs(seqs)
            r_new = await e.generate(_req("new", p, greedy=True, max_new_tokens=20))
            return before, after, await t, r_new
        finally:
            await e.close()

    before, after, r_in, r_new = asyncio.run(main())
    for a, b in zip(before, old):
        assert len(a) == len(b) and _max_err(a, b) < 1e-4
    for a, b in zip(after, want):
        assert _max_err(a, b) < 1e-4, "log-probs after the update differ from a model built from the folder"
    v = r_in.outputs[0].versions
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v), f"in-flight versions should go 0 -> 1, got {set(v)}"
    assert len(v) == 400 and r_in.outputs[0].finish_reason == "length"
    assert r_new.outputs[0].versions == [1] * 20
    assert r_new.outputs[0].output_ids == ref_new


def _sender(spec_kw, folder, q):
    """Trainer side of the weight group: one unusable update (the engine must refuse it and stay in step),
    the real one, then a third one that dies after 3 tensors."""
    try:
        from realhf.gen_server.weight_group import WeightGroup, metas_of, send

        named = _named_hf(folder)
        bad = _bad_named(named)
        group = WeightGroup(WeightGroupSpec(**spec_kw), rank=0)
        send(group, bad, metas_of(bad))
        send(group, named, metas_of(named))
        group.barrier()
        q.put("ok")
        send(group, named, metas_of(named)[:3])
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(f"{type(e).__name__}: {e}")
    os._exit(0)  # the trainer dies in the middle of an update


def test_update_weights_from_group(path, perturbed):
    from realhf.testing import free_port
    from realhf.gen_server.weight_group import metas_of

    seqs = _prompts(lens=[9, 5, 12], seed=9)
    want = _fresh_logprobs(_build(perturbed), seqs)
    named = _named_hf(perturbed)
    spec_kw = dict(master_addr="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                   group_name="test-gen-engine", timeout_secs=120.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sender, args=(spec_kw, perturbed, q), daemon=True)
    proc.start()

    async def main():
        e = _engine(path)
        await e.start()
        try:
            t = asyncio.create_task(e.generate(_req("inflight", seqs[0], greedy=True, max_new_tokens=60)))
            await e.init_weight_group(WeightGroupSpec(**spec_kw))
            with pytest.raises(ValueError, match="mlp.extra"):
                await e.update_weights_from_group(metas_of(_bad_named(named)), 5)
            assert e.version == 0
            await e.update_weights_from_group(metas_of(named), 2)
            await asyncio.to_thread(e._weight_group.barrier)
            got = await e.logprobs(seqs), e.version, await t
            # the trainer dies after 3 tensors of the next update: the weights are a mix, nothing is served
            t2 = asyncio.create_task(e.generate(_req("doomed", seqs[0], greedy=True, max_new_tokens=400)))
            await _until(lambda: e.metrics()["running_requests"] == 1, "request doomed to run")
            with pytest.raises(Exception):
                await e.update_weights_from_group(metas_of(named), 3)
            with pytest.raises(RuntimeError, match="incomplete"):
                await t2
            with pytest.raises(RuntimeError, match="incomplete"):
                await e.generate(_req("refused", seqs[0], greedy=True, max_new_tokens=4))
            with pytest.raises(RuntimeError, match="incomplete"):
                await e.logprobs(seqs)
            assert e.version == 2
            await e.update_weights_from_disk(perturbed, 4)  # a complete set serves again
            after = await e.logprobs(seqs)
            return got, after, e.metrics()
        finally:
            await e.close()

    try:
        (got, version, r_in), after, m = asyncio.run(main())
        assert q.get(timeout=60) == "ok"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert version == 2
    for a, b in zip(got, want):
        assert _max_err(a, b) < 1e-4, "log-probs after the group update differ from a model built from the folder"
    assert r_in.outputs[0].finish_reason == "length" and set(r_in.outputs[0].versions) <= {0, 2}
    for a, b in zip(after, want):
        assert _max_err(a, b) < 1e-4
    assert m["version"] == 4 and m["running_requests"] == 0 and m["failed_requests"] == 1
