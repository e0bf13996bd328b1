"""Weights shared by reference with a generation server on the trainer's host (realhf/gen_server/weight_share.py;
CUDA IPC handles on a GPU: tests/gpu/test_gen_server_gpu.py): what another process maps is what was shared, bit for
bit, in every dtype, the buffer reused from one update to the next; a malformed, foreign or overreaching part is
refused before anything is mapped; the gen engine loads shared weights as it loads a folder, refusing an update that
does not fit or is stale with nothing changed."""
import asyncio
import logging
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

from realhf.api.core.generation import RequestError
from realhf.gen_server import weight_share
from realhf.gen_server.weight_share import SharedWriter, open_part

from support.gen_engine_util import _bad_named, _build, _engine, _fresh_logprobs, _max_err, _named_hf, _prompts, _req
from support.gen_engine_util import path_fixture, perturbed_fixture  # noqa: F401 - the fixtures `path`, `perturbed`


def _tensors(seed: int, scale: int = 1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6 * scale, 10, generator=g)
    return {
        "a.weight": base,
        "b.bf16": torch.randn(3, 7 * scale, generator=g).to(torch.bfloat16),
        "c.int64": torch.randint(-5, 5, (13,), generator=g),
        "d.empty": torch.zeros(0, 4),
        "e.transposed": base.t(),  # not contiguous: shared as a contiguous copy
        "f.half": torch.randn(5, generator=g).half(),
        "g.scalar": torch.tensor(3.5),
    }


def _reader(inbox, outbox):
    """Another process: maps every part it is sent and returns copies of what it read (or the error)."""
    while True:
        part = inbox.get()
        if part is None:
            return
        try:
            outbox.put({n: t.clone() for n, t in open_part(part)})
        except Exception as e:  # noqa: BLE001 - reported to the test
            outbox.put(f"{type(e).__name__}: {e}")


def test_another_process_reads_what_was_shared():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(inbox, outbox), daemon=True)
    proc.start()
    w = SharedWriter("test")
    try:
        first = None
        for seed, scale in ((1, 1), (2, 1), (3, 4)):
            named = _tensors(seed, scale)
            part = w.share(named)
            assert part["device"] == "cpu" and part["host"] == weight_share.host_id()
            first = first or part
            if seed == 2:  # the same tensors again: the buffer is reused, not made anew
                assert part["buffers"] == first["buffers"]
            inbox.put(part)
            got = outbox.get(timeout=120)
            assert isinstance(got, dict), got
            assert list(got) == list(named)
            for n, t in named.items():
                assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
                assert torch.equal(got[n], t), n
        assert w.buffer_bytes >= sum(t.numel() * t.element_size() for t in _tensors(3, 4).values())
        assert part["buffers"] != first["buffers"]  # outgrown: a larger buffer
        w.close()  # the trainer is done: its buffer is gone
        inbox.put(part)
        got = outbox.get(timeout=60)
        assert isinstance(got, str) and "cannot open" in got, got
    finally:
        w.close()
        inbox.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _refused(part, *fragments):
    with pytest.raises(RequestError) as ei:
        list(open_part(part))
    for f in fragments:
        assert f in str(ei.value), (f, str(ei.value))


def test_malformed_foreign_or_overreaching_parts_are_refused():
    w = SharedWriter("test")
    try:
        part = w.share(_tensors(1))
        assert {n for n, _ in open_part(part)} == set(_tensors(1))

        def edit(fn):
            p = {**part, "buffers": [dict(b) for b in part["buffers"]], "tensors": [dict(t) for t in part["tensors"]]}
            fn(p)
            return p

        _refused(edit(lambda p: p.update(host="elsewhere/boot")), "comes from host 'elsewhere/boot'", "group")
        _refused(edit(lambda p: p["buffers"][0].update(path="/etc/passwd")), "/proc/<pid>/fd/<n>")
        _refused(edit(lambda p: p["tensors"][0].update(offset=part["buffers"][0]["nbytes"])), "past its buffer")
        _refused(edit(lambda p: p["tensors"][0].update(stride=[10 ** 9, 1])), "past its buffer")
        _refused(edit(lambda p: p["tensors"][0].update(stride=[1])), "stride", "1 entries")
        _refused(edit(lambda p: p["tensors"][0].update(dtype="complex_thing")), "unknown tensor dtype")
        _refused(edit(lambda p: p["tensors"][0].update(buffer=3)), "outside the part's 1 buffers")
        _refused(edit(lambda p: p["tensors"][0].update(shape=[-1, 10])), "non-negative")
        _refused(edit(lambda p: p.update(device="tpu")), "'device' must be cpu or cuda")
        _refused(edit(lambda p: p["buffers"][0].update(kind="cuda_ipc")), "kind 'memfd'")
        # a real file descriptor, but not a shared weight buffer: not mapped
        with tempfile.TemporaryFile() as f:
            f.write(b"\0" * 4096)
            f.flush()
            _refused(edit(lambda p: p["buffers"][0].update(path=f"/proc/{os.getpid()}/fd/{f.fileno()}")),
                     "is not a shared weight buffer")
        # the buffer is smaller than announced
        big = part["buffers"][0]["nbytes"] * 2
        _refused(edit(lambda p: (p["buffers"][0].update(nbytes=big), p["tensors"][0].update(offset=big // 4 - 60))),
                 "fewer than the")
        if not torch.cuda.is_available():
            with pytest.raises(RequestError, match="CUDA memory was shared, but this server has no GPU"):
                weight_share._map_cuda({"device_uuid": "GPU-x"}, "test")
    finally:
        w.close()


def _share_and_wait(folder, parts_out, done):
    """The trainer's side for the engine test: shares the HF tensors of ``folder`` (a bad set first: an extra tensor,
    then the real one) and keeps each alive until the test says it has been read."""
    try:
        named = _named_hf(folder)
        w = SharedWriter("trainer")
        for n in (_bad_named(named), named):
            parts_out.put(w.share(n))
            done.get(timeout=300)
        w.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        parts_out.put(f"{type(e).__name__}: {e}")


def test_engine_loads_weights_shared_by_another_process(path, perturbed):
    seqs = _prompts(lens=[9, 5, 12], seed=9)
    want = _fresh_logprobs(_build(perturbed), seqs)
    ctx = mp.get_context("spawn")
    parts, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_share_and_wait, args=(perturbed, parts, done), daemon=True)
    proc.start()

    async def main():
        e = _engine(path)
        await e.start()
        try:
            before = await e.logprobs(seqs)
            t = asyncio.create_task(e.generate(_req("inflight", seqs[0], greedy=True, max_new_tokens=60)))
            bad = await asyncio.to_thread(parts.get, True, 120)
            assert isinstance(bad, dict), bad
            with pytest.raises(ValueError, match="nothing loaded.*mlp.extra"):
                await e.update_weights_from_shared([bad], 5)
            assert e.version == 0 and await e.logprobs(seqs) == before
            done.put(1)
            good = await asyncio.to_thread(parts.get, True, 120)
            assert isinstance(good, dict), good
            await e.update_weights_from_shared([good], 3)
            got = await e.logprobs(seqs)
            with pytest.raises(RequestError, match="older than the served version 3"):
                await e.update_weights_from_shared([good], 2)
            with pytest.raises(RequestError, match="non-empty list"):
                await e.update_weights_from_shared([], 4)
            done.put(1)
            return before, got, e.version, await t, e.metrics()
        finally:
            await e.close()

    try:
        before, got, version, r_in, m = asyncio.run(main())
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert version == 3 and m["weight_updates"] == 1
    assert max(_max_err(a, b) for a, b in zip(before, want)) > 1e-2  # the update changes log-probs ...
    for a, b in zip(got, want):  # ... to those of a model built from the folder
        assert _max_err(a, b) < 1e-5
    assert r_in.outputs[0].finish_reason == "length" and set(r_in.outputs[0].versions) <= {0, 3}


def test_shared_weights_need_realhf_servers_and_memory_realloc(tmp_path):
    from realhf.api.quickstart import config as qc
    from realhf.api.quickstart.entry import ConfigError, load_config
    from realhf.experiments.common import gen_servers_spec
    from realhf.impl.model.tiny import ensure_tiny_model

    data = tmp_path / "math.jsonl"
    data.write_text('{"query_id": "1", "prompt": "1+1=", "solutions": ["2"]}\n')
    base = [f"actor.path={ensure_tiny_model('qwen2')}", f"dataset.path={data}", "n_devices_per_node=2"]

    def spec(*overrides):
        return gen_servers_spec(load_config(qc.PPOMathConfig, overrides=base + list(overrides)), 64)

    ok = spec("allocation_mode=gen.d1m1p1+d1m1p1", "param_realloc=memory", "gen_server.weight_transport=shared")
    assert ok.weight_transport == "shared" and ok.backend == "gen"
    # SGLang's own server does not take them (refused before asking whether it is installed)
    with pytest.raises(ValueError, match="only realhf's servers.*sglang"):
        spec("allocation_mode=sglang.d1m1p1+d1m1p1", "param_realloc=memory", "gen_server.weight_transport=shared")
    for t in ("shared", "group"):
        with pytest.raises(ConfigError, match=f"weight_transport={t} says how trained weights move in memory.*"
                                              "param_realloc=disk.*set param_realloc=memory"):
            spec("allocation_mode=gen.d1m1p1+d1m1p1", "param_realloc=disk", f"gen_server.weight_transport={t}")
    assert spec("allocation_mode=gen.d1m1p1+d1m1p1").weight_transport == "auto"


def test_a_cpu_runs_shared_buffer_is_counted_in_the_host_memory(tmp_path, monkeypatch):
    """On CPU the publisher keeps one copy of the served model's weights in shared memory for the servers: the host's
    share per process is that much smaller (and says so); not with weight_transport=group."""
    from realhf.api.quickstart import config as qc
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec
    from realhf.experiments.memory_plan import CAPACITY_ENV, capacity
    from realhf.impl.model.tiny import ensure_tiny_model

    monkeypatch.setenv(CAPACITY_ENV, "8")
    data = tmp_path / "math.jsonl"
    data.write_text('{"query_id": "1", "prompt": "1+1=", "solutions": ["2"]}\n')
    model = ensure_tiny_model("qwen2")
    base = [f"actor.path={model}", f"dataset.path={data}", "n_devices_per_node=2",
            "allocation_mode=gen.d1m1p1+d1m1p1"]

    def cap(*extra):
        cfg = load_config(qc.PPOMathConfig, overrides=base + list(extra))
        return capacity(cfg, build_spec("ppo-math", cfg))

    shared, group = cap(), cap("gen_server.weight_transport=group")
    from safetensors.torch import load_file

    n_params = sum(t.numel() for t in load_file(os.path.join(model, "model.safetensors")).values())
    # the buffer is split among the worker and the server
    assert (group.per_rank - shared.per_rank) * 2 == pytest.approx(4 * n_params, rel=0.02)
    assert "weights shared with them" in shared.source and "weights shared" not in group.source
    assert cap("param_realloc=disk").per_rank == group.per_rank


def test_auto_falls_back_to_the_weight_group_until_a_shared_update_has_worked(tmp_path, monkeypatch):
    """The publisher with gen_server.weight_transport=auto, against a real gen server process: a first shared update
    the server refuses (here: the parts claim another host) falls back to the weight group, which loads the weights
    (the server's log-probs become the trainer's) and stays the run's transport. Once a shared update has worked, a
    later failure is the run's: raised, not hidden."""
    import types

    from realhf.api.core.system_api import GenServersSpec
    from realhf.gen_server.client import GenServerError
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.model.tiny import ensure_tiny_model
    from realhf.system.trainer.served import WeightPublisher
    from realhf.testing import perturbed_model, sequence_logprobs

    tiny = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    seqs = _prompts(lens=[7, 4], seed=3)
    spec = types.SimpleNamespace(save_dir=str(tmp_path), rollout=None, experiment_name="e", trial_name="t")
    fleet_spec = GenServersSpec(backend="gen", n_servers=1, param_realloc="memory", weight_transport="auto")
    env = types.SimpleNamespace(device=torch.device("cpu"))
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("realhf.system.trainer.served").addHandler(handler)

    def trainer(seed):
        m, _ = perturbed_model(tiny, str(tmp_path), seed=seed)
        return types.SimpleNamespace(module=m, grid=m.grid), m

    try:
        with LocalFleet("gen", tiny, 1, dtype="float32", device="cpu", max_model_len=128) as f:
            c = f.client()
            for first_works in (False, True):
                pub = WeightPublisher(spec, fleet_spec, b"s" * 32, None, env, f"actor@{int(first_works)}")
                pub.client = c
                model, m = trainer(seed=11 + first_works)
                if not first_works:  # the parts claim another host: the server refuses them
                    monkeypatch.setattr(weight_share, "host_id", lambda: "elsewhere/boot")
                    pub.transport = "shared"  # as auto chose it
                pub.publish(model, 1 + 2 * first_works)
                monkeypatch.undo()
                assert _max_err(c.logprobs(seqs)[0], sequence_logprobs(m, seqs)[0]) < 1e-4
                if not first_works:
                    assert pub.transport == "group" and pub.group is not None
                    assert any("falling back to the weight group" in w and "comes from host 'elsewhere/boot'" in w
                               for w in warned), warned
                else:
                    assert pub.transport == "shared"
                    monkeypatch.setattr(weight_share, "host_id", lambda: "elsewhere/boot")
                    with pytest.raises(GenServerError, match="comes from host 'elsewhere/boot'"):
                        pub.publish(model, 4)
                    monkeypatch.undo()
    finally:
        logging.getLogger("realhf.system.trainer.served").removeHandler(handler)
