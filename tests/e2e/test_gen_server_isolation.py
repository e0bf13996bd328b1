"""One bad request must not fail its batch: a real ``gen`` generation server (a subprocess over HTTP) decodes several
requests together (paused while they arrive, so that they are admitted in one prefill and decoded in the same steps).

* Requests whose sampling parameters cannot be sampled (temperature 1e-40, a stop list covering the vocabulary with
  ``min_new_tokens``, ``greedy: "false"``) are refused with 400 naming the field; the others succeed.
* A request whose sampling genuinely fails at run time (a stop list leaving only a token whose probability underflows
  to zero at its temperature), at admission or in a later decode step, fails alone; its neighbours, one of them
  sampled by the same call, succeed with the tokens they get alone.
* ``/update_weights_from_disk`` refuses a folder without config.json, non-finite weights, tensors the model lacks and
  an older version (400), and the served weights stay as they were.
"""
import asyncio
import os
import shutil
import time

import pytest
import torch

from realhf.gen_server.api import GenerateRequest, SamplingParams
from realhf.gen_server.client import GenClient, GenServerError
from test_gen_server import SECRET, start_server, stop

MAX_NEW = 8
TEMP = 1e-4  # allowed, but so low that a token a little below the best one gets probability exactly 0 in fp32
P_GOOD = [[5, 17, 33, 2], [9, 1, 4]]


@pytest.fixture(scope="module")
def tiny():
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2")  # untied: its next token is not simply its last one again


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    proc, addr = start_server(tiny, tmp_path_factory.mktemp("srv"))
    yield addr
    stop(proc)


@pytest.fixture(scope="module")
def ref(tiny):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's small ops only lose time to synchronising threads
    try:
        yield build_from_hf(tiny, grid=single_process_grid(), dtype=torch.float32, device="cpu")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def want(ref):
    """What the good requests get alone: in-process generation (greedy; seeded samples of the same seed)."""
    from realhf.api.core.model_api import GenerationHyperparameters as G
    from realhf.impl.model.nn.generation import generate

    return (generate(ref, P_GOOD[:1], G(greedy=True, max_new_tokens=MAX_NEW)).tokens[0],
            generate(ref, P_GOOD[1:], G(n=2, max_new_tokens=MAX_NEW), seeds=[11]).tokens)


def run(coro_fn, addr):
    async def go():
        c = GenClient([addr], SECRET, retries=0)
        try:
            return await coro_fn(c)
        finally:
            await c.close()

    return asyncio.run(go())


def together(addr, reqs):
    """Results (or errors) of ``reqs`` admitted in one batch: the server is paused until every request it accepts
    is waiting."""

    async def go(c):
        await c.pause()
        tasks = [asyncio.ensure_future(c.generate(r)) for r in reqs]
        try:
            t0 = time.monotonic()
            # accepted requests cannot finish while paused: once they all wait, the refused ones are answered
            while (await c.metrics())[0]["waiting_requests"] != sum(not t.done() for t in tasks):
                assert time.monotonic() - t0 < 120, "the requests did not arrive"
                await asyncio.sleep(0.01)
        finally:
            await c.resume()
        return await asyncio.gather(*tasks, return_exceptions=True)

    return run(go, addr)


def last_logits(model, ids):
    from realhf.impl.model.nn.real_model import make_packed_input

    with torch.no_grad():
        return model(torch.tensor(ids), make_packed_input([len(ids)])).float()[-1]


def good_requests(tag):
    return [GenerateRequest(f"{tag}-greedy", P_GOOD[0], SamplingParams(greedy=True, max_new_tokens=MAX_NEW)),
            GenerateRequest(f"{tag}-cold", P_GOOD[1], SamplingParams(temperature=TEMP, max_new_tokens=MAX_NEW)),
            GenerateRequest(f"{tag}-seeded", P_GOOD[1], SamplingParams(n=2, max_new_tokens=MAX_NEW, seed=11))]


def check_good(want, results):
    """The neighbours succeeded, with the tokens they get alone."""
    for r in results:
        assert not isinstance(r, BaseException), f"a good request failed: {r}"
    greedy, cold, seeded = results
    assert greedy.outputs[0].output_ids == want[0]
    assert len(cold.outputs[0].output_ids) == MAX_NEW and cold.outputs[0].finish_reason == "length"
    assert [o.output_ids for o in seeded.outputs] == want[1]


def only(token, vocab):
    return [t for t in range(vocab) if t != token]


def test_unsamplable_requests_are_refused_and_their_batch_goes_on(server, ref, want):
    V = ref.config.vocab_size
    bad = [GenerateRequest("tiny-t", [7, 8, 9], SamplingParams(temperature=1e-40, max_new_tokens=MAX_NEW)),
           GenerateRequest("all-stop", [7, 8], SamplingParams(min_new_tokens=1, stop_token_ids=list(range(V)),
                                                              max_new_tokens=MAX_NEW)),
           GenerateRequest("str-bool", [7, 8], SamplingParams(greedy="false", max_new_tokens=MAX_NEW)),
           GenerateRequest("int-bool", [7, 8], SamplingParams(greedy=1, max_new_tokens=MAX_NEW))]
    res = together(server, good_requests("v") + bad)
    check_good(want, res[:3])
    for r, field in zip(res[3:], ("temperature", "stop_token_ids", "greedy", "greedy")):
        assert isinstance(r, GenServerError) and r.status == 400 and f"sampling.{field}=" in str(r), (field, r)


def test_a_request_that_fails_to_sample_fails_alone(server, ref, want):
    V = ref.config.vocab_size
    # at admission: the only token left to sample is the least likely one, whose probability is 0 at TEMP
    p_adm = [40, 41, 42]
    first = only(int(last_logits(ref, p_adm).argmin()), V)
    # in the second step: the only token left is the best first token, which the next step ranks below another
    for seed in range(100):
        p_dec = torch.randint(3, V, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        l1 = last_logits(ref, p_dec)
        top2 = l1.topk(2).values
        x = int(l1.argmax())
        l2 = last_logits(ref, p_dec + [x])
        if top2[0] - top2[1] > 1e-3 and l2.max() - l2[x] > 200 * TEMP:
            break
    else:
        pytest.fail("no prompt whose best first token falls behind in the next step")
    cases = [(GenerateRequest("adm", p_adm, SamplingParams(temperature=TEMP, min_new_tokens=1, stop_token_ids=first,
                                                           max_new_tokens=MAX_NEW)), "a"),
             (GenerateRequest("dec", p_dec, SamplingParams(temperature=TEMP, min_new_tokens=2,
                                                           stop_token_ids=only(x, V), max_new_tokens=MAX_NEW)), "d")]
    for bad, tag in cases:
        res = together(server, good_requests(tag) + [bad])
        check_good(want, res[:3])
        err = res[3]
        assert isinstance(err, GenServerError) and err.status == 500, err
        assert f"request '{bad.rid}'" in str(err) and "invalid multinomial distribution" in str(err), err
    # every row of the batch sampled by one call: that call raises, and each request is sampled on its own
    cold, err = together(server, [good_requests("w")[1], cases[0][0]])
    assert not isinstance(cold, BaseException) and len(cold.outputs[0].output_ids) == MAX_NEW, cold
    assert isinstance(err, GenServerError) and err.status == 500 and "request 'adm'" in str(err), err
    m = run(lambda c: c.metrics(), server)[0]
    assert m["running_requests"] == m["waiting_requests"] == 0


def _edited_copy(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    named = load_file(f)
    edit(named)
    save_file(named, f, metadata={"format": "pt"})
    return dst


def test_bad_weight_updates_are_refused_and_change_nothing(server, tiny, tmp_path):
    seqs = [[3, 8, 20, 41, 7], [11, 12, 13]]
    before = run(lambda c: c.logprobs(seqs), server)
    no_cfg = shutil.copytree(tiny, str(tmp_path / "no_cfg"))
    os.remove(os.path.join(no_cfg, "config.json"))

    def nan(named):
        named["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")

    def extra(named):
        named["model.layers.0.mlp.extra.weight"] = torch.zeros(3)

    cases = [(no_cfg, "config.json"), (_edited_copy(tiny, str(tmp_path / "nan"), nan), "model.layers.1.mlp.up_proj"),
             (_edited_copy(tiny, str(tmp_path / "extra"), extra), "model.layers.0.mlp.extra.weight")]
    v0 = run(lambda c: c.health(), server)[0]["version"]
    for folder, frag in cases:
        with pytest.raises(GenServerError) as ei:
            run(lambda c: c.update_weights_from_disk(folder, v0 + 1), server)
        assert ei.value.status == 400 and frag in str(ei.value) and folder in str(ei.value), str(ei.value)
    run(lambda c: c.update_weights_from_disk(tiny, v0 + 3), server)
    with pytest.raises(GenServerError) as ei:
        run(lambda c: c.update_weights_from_disk(tiny, v0 + 2), server)
    assert ei.value.status == 400 and f"version={v0 + 2}" in str(ei.value), str(ei.value)
    assert run(lambda c: c.health(), server)[0]["version"] == v0 + 3
    assert run(lambda c: c.logprobs(seqs), server) == before  # the weights never changed
