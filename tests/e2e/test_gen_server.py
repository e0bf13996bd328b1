"""Generation servers over real HTTP: realhf's own engine (``gen``) in a real server process, driven by the one
client every caller uses. The vLLM engine behind the same server is covered in tests/unit/test_vllm_engine.py and
tests/e2e/test_vllm_server.py.

Checked here: greedy and seeded outputs equal in-process generation; signed requests only (forged, replayed,
tampered and malformed requests are refused and change nothing); loopback binding; weight updates from disk
and over a weight group make the server's log-probs equal the trainer's; routing, retries on another server
and errors that name the server; a server that cannot start reports why.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from realhf.testing import perturbed_model, sequence_logprobs
from realhf.gen_server.api import GenerateRequest, SamplingParams, sample_seed
from realhf.gen_server.client import GenClient, GenServerError
from realhf.base.run_secret import new_run_secret

SECRET = new_run_secret()


def start_server(model, tmp, index=0, backend="gen", secret=SECRET, extra_args=(), wait=True):
    addr_file = os.path.join(str(tmp), f"server{index}.addr")
    if os.path.exists(addr_file):
        os.remove(addr_file)
    log = open(os.path.join(str(tmp), f"server{index}.log"), "w")
    env = dict(os.environ, REALHF_RUN_SECRET=secret.hex(), OMP_NUM_THREADS="1")
    env.pop("REALHF_HOST", None)
    proc = subprocess.Popen([sys.executable, "-m", "realhf.gen_server.server", "--backend", backend, "--model", model,
                             "--max-model-len", "512", "--index", str(index), "--address-file", addr_file,
                             *extra_args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc, None
    t0 = time.time()
    while not os.path.exists(addr_file):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{open(log.name).read()[-3000:]}")
        assert time.time() - t0 < 300, "server did not come up"
        time.sleep(0.1)
    return proc, open(addr_file).read()


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def tiny():
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    proc, addr = start_server(tiny, tmp_path_factory.mktemp("srv"))
    yield proc, addr
    stop(proc)


@pytest.fixture(scope="module")
def ref_model(tiny):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    return build_from_hf(tiny, grid=single_process_grid(), dtype=torch.float32, device="cpu")


def run(coro_fn, addrs, **kw):
    async def go():
        c = GenClient(addrs, SECRET, **kw)
        try:
            return await coro_fn(c)
        finally:
            await c.close()

    return asyncio.run(go())


PROMPTS = [[5, 17, 33, 2], [9, 1], [100, 200, 300, 400, 500, 7], [42]]


def test_greedy_and_seeded_equal_in_process_generation(server, ref_model):
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.nn.generation import generate

    _, addr = server
    reqs = [GenerateRequest(f"g{i}", p, SamplingParams(greedy=True, max_new_tokens=12)) for i, p in enumerate(PROMPTS)]
    reqs += [GenerateRequest(f"s{i}", p, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=1000 + i))
             for i, p in enumerate(PROMPTS)]
    res = run(lambda c: c.generate_many(reqs), [addr])
    g = generate(ref_model, PROMPTS, GenerationHyperparameters(greedy=True, max_new_tokens=12))
    for i in range(len(PROMPTS)):
        o = res[i].outputs[0]
        assert o.output_ids == g.tokens[i]
        assert max(abs(a - b) for a, b in zip(o.logprobs, g.logprobs[i])) < 1e-4
        assert o.finish_reason == "length" and o.versions == [0] * 12
    s = generate(ref_model, PROMPTS, GenerationHyperparameters(n=3, temperature=1.0, max_new_tokens=10),
                 seeds=[1000 + i for i in range(len(PROMPTS))])
    for i in range(len(PROMPTS)):
        got = [o.output_ids for o in res[len(PROMPTS) + i].outputs]
        assert got == s.tokens[3 * i: 3 * i + 3], f"prompt {i}"
    assert sample_seed(7, 2) == 7 * 1000003 + 2


def _raw_post(addr, path, body: bytes, headers):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{addr}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_forged_replayed_tampered_and_malformed_requests_are_refused(server):
    from realhf.gen_server.auth import sign

    _, addr = server
    m0 = run(lambda c: c.metrics(), [addr])[0]
    assert addr.startswith("127.0.0.1:")  # loopback unless a cluster launcher says otherwise
    body = json.dumps({"path": "/tmp", "version": 99}).encode()
    ct = {"Content-Type": "application/json"}
    # unsigned, and signed with another run's secret
    assert _raw_post(addr, "/update_weights_from_disk", body, ct)[0] == 401
    assert _raw_post(addr, "/pause", b"{}", {**ct, **sign(new_run_secret(), "POST", "/pause", b"{}")})[0] == 401
    # a signature for another endpoint, or another body
    h = sign(SECRET, "POST", "/pause", b"{}")
    assert _raw_post(addr, "/abort", b"{}", {**ct, **h})[0] == 401
    h = sign(SECRET, "POST", "/update_weights_from_disk", b'{"path": "/tmp", "version": 1}')
    assert _raw_post(addr, "/update_weights_from_disk", body, {**ct, **h})[0] == 401
    # a captured request cannot run twice
    h = sign(SECRET, "POST", "/continue", b"{}")
    assert _raw_post(addr, "/continue", b"{}", {**ct, **h})[0] == 200
    code, ans = _raw_post(addr, "/continue", b"{}", {**ct, **h})
    assert code == 401 and "replayed" in ans["error"]
    # authentic but malformed: 400 naming the problem
    for path, b, frag in [("/generate", b"{not json", "JSONDecodeError"),
                          ("/generate", b'{"rid": "x", "input_ids": [1], "sampling": {"nn": 2}}', "unknown sampling keys"),
                          ("/generate", b'{"rid": "x", "input_ids": "12"}', "input_ids"),
                          ("/update_weights_from_disk", b'{"path": "/nonexistent", "version": 1}', "existing folder"),
                          ("/update_weights_from_distributed", b'{"tensors": [{"name": 1, "bogus": 2}], "version": 1}', "unknown")]:
        code, ans = _raw_post(addr, path, b, {**ct, **sign(SECRET, "POST", path, b)})
        assert code == 400 and frag in ans["error"], (path, code, ans)
    m1 = run(lambda c: c.metrics(), [addr])[0]
    assert m1["version"] == m0["version"] == 0 and not m1["paused"]
    assert m1["rejected_requests"] >= m0["rejected_requests"] + 5


SEQS = [[3, 8, 20, 41, 7, 99], [11, 12, 13], [250, 4, 4, 4, 90, 1, 2, 3]]


def test_weight_update_from_disk_matches_the_trainer(server, tiny, tmp_path):
    _, addr = server
    m, path = perturbed_model(tiny, tmp_path, seed=1)
    before = run(lambda c: c.logprobs(SEQS), [addr])

    async def go(c):
        upd = await c.update_weights_from_disk(path, 5)
        lp = await c.logprobs(SEQS)
        r = await c.generate(GenerateRequest("after", [1, 2, 3], SamplingParams(greedy=True, max_new_tokens=4)))
        return upd, lp, r, (await c.health())[0]

    upd, after, r, h = run(go, [addr])
    want = sequence_logprobs(m, SEQS)
    assert max(abs(a - b) for x, y in zip(after, want) for a, b in zip(x, y)) < 1e-4
    assert max(abs(a - b) for x, y in zip(before, want) for a, b in zip(x, y)) > 1e-3  # the update changed them
    assert h["version"] == 5 and r.outputs[0].versions == [5] * 4


def test_weight_update_over_a_weight_group_matches_the_trainer(server, tiny, tmp_path):
    """The trainer side joins a real gloo group with the server, as a model worker does (WeightPublisher)."""
    import dataclasses
    import threading

    from realhf.testing import free_port
    from realhf.gen_server.api import WeightGroupSpec
    from realhf.gen_server.weight_group import WeightGroup, metas_of, send
    from realhf.impl.model.conversion.hf_io import stage_hf_state

    _, addr = server
    m, _ = perturbed_model(tiny, tmp_path, seed=2)
    hf = stage_hf_state(m)
    metas = metas_of(hf, src=0)
    spec = WeightGroupSpec("127.0.0.1", free_port(), 0, 2, f"test-{os.getpid()}", "gloo", 60.0)

    async def go(c):
        joined = asyncio.ensure_future(c.init_weight_group([dataclasses.replace(spec, rank_offset=1)]))
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("g", WeightGroup(spec, rank=0)))
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.05)
        await joined
        upd = asyncio.ensure_future(c.update_weights_from_group(metas, 7))
        t = threading.Thread(target=send, args=(box["g"], hf, metas))
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.05)
        await upd
        return await c.logprobs(SEQS), (await c.health())[0]

    got, h = run(go, [addr])
    want = sequence_logprobs(m, SEQS)
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-4
    assert h["version"] == 7


def test_routing_retries_and_errors_name_the_server(tiny, tmp_path):
    (p0, a0), (p1, a1) = start_server(tiny, tmp_path, 0), start_server(tiny, tmp_path, 1)
    try:
        reqs = [GenerateRequest(f"r{i}", [1 + i, 2], SamplingParams(greedy=True, max_new_tokens=3)) for i in range(8)]

        async def go(c):
            await c.generate_many(reqs)
            return [m["generated_tokens"] for m in await c.metrics()]

        per = run(go, [a0, a1], routing="round_robin")
        assert per == [12, 12]  # 4 requests x 3 tokens each
        # one server dies: requests are retried on the other, which serves them all
        os.killpg(p0.pid, signal.SIGKILL)
        p0.wait()
        per2 = run(lambda c: c.generate_many(reqs), [a0, a1], routing="round_robin")
        assert len(per2) == 8 and all(len(r.outputs[0].output_ids) == 3 for r in per2)
        # the only server is dead: the error names it
        with pytest.raises(GenServerError) as e:
            run(lambda c: c.generate(reqs[0]), [a0], retries=0)
        assert f"0 ({a0})" in str(e.value) and "cannot reach" in str(e.value)
    finally:
        stop(p0)
        stop(p1)


def test_a_server_that_cannot_start_says_why(tmp_path):
    proc, _ = start_server(str(tmp_path / "no-such-model"), tmp_path, wait=False)
    proc.wait(120)
    log = open(tmp_path / "server0.log").read()
    assert proc.returncode != 0
    assert "no-such-model" in log and "failed" in log
    # a port that is taken
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    from realhf.impl.model.tiny import ensure_tiny_model

    proc, _ = start_server(ensure_tiny_model("qwen2", tie_word_embeddings=True), tmp_path, index=3,
                           extra_args=["--port", str(port)], wait=False)
    proc.wait(120)
    s.close()
    log = open(tmp_path / "server3.log").read()
    assert proc.returncode != 0 and f"127.0.0.1:{port}" in log and "is the port taken" in log


def test_served_generation_keeps_every_tokens_weight_version(server, tiny, tmp_path):
    """actor_gen through servers (the ServedEngine a model worker holds): the samples equal those of the colocated
    engine, and ``packed_versions`` holds the server's weight version for each generated token (-1 on prompts)."""
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import GenerationHyperparameters, Model
    from realhf.gen_server.client import SyncGenClient
    from realhf.system.trainer.served import ServedEngine
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.interface.gen_interface import GenerationInterface

    _, addr = server
    m, path = perturbed_model(tiny, tmp_path, seed=4)
    run(lambda c: c.update_weights_from_disk(path, 9), [addr])
    prompts = [[5, 9, 14], [7, 3], [11, 12, 13, 4]]
    data = torch.cat([torch.tensor(p) for p in prompts])
    sample = SequenceSample(keys={"packed_prompts"}, ids=[f"q{i}" for i in range(3)],
                            seqlens={"packed_prompts": [[len(p)] for p in prompts]},
                            trailing_shapes={"packed_prompts": ()}, dtypes={"packed_prompts": torch.long},
                            data={"packed_prompts": data})
    iface = GenerationInterface(GenerationHyperparameters(n=2, max_new_tokens=5, temperature=1.0), seed=3)
    client = SyncGenClient([addr], SECRET)
    try:
        served = iface.generate(Model("actor@1", ServedEngine(client), None, None, tiny, version=9), sample,
                                MicroBatchSpec())
    finally:
        client.close()
    local = iface.generate(Model("actor", InferenceEngine(m), None, None, tiny, version=9), sample, MicroBatchSpec())
    assert torch.equal(served.data["packed_input_ids"], local.data["packed_input_ids"])
    assert "packed_versions" in served.keys and "packed_versions" not in local.keys
    v, pm = served.data["packed_versions"], served.data["prompt_mask"]
    assert v.shape == pm.shape and bool((v[pm] == -1).all()) and bool((v[~pm] == 9).all())
