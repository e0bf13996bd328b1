"""Generation servers on CUDA (every test needs a GPU).

* the vLLM server on CUDA: greedy tokens equal ``transformers`` greedy; an update over an NCCL weight group
  makes its log-probs the trainer's; its version is the one published;
* realhf's own server (``gen``) on CUDA in bf16: seeded outputs equal in-process generation on CUDA; in fp32 its
  decode step replayed as CUDA graphs gives its eager step's samples; weights shared with it by CUDA IPC handles;
* SGLang's own server (when sglang is installed): generation, log-probs and an update from disk through the
  client's SGLang dialect;
* ppo-math with ``vllm.d1m1p1+d1m1p1`` on two GPUs, weights published over NCCL.
"""
import dataclasses
import importlib.util
import os
import threading

import pytest
import torch

from realhf.testing import perturbed_model, read_stats, run_quickstart, sequence_logprobs
from realhf.gen_server.api import GenerateRequest, SamplingParams, WeightGroupSpec
from realhf.impl.model.tiny import ensure_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7], [11, 12, 13, 14, 15, 16, 17], [8, 99]]
SEQS = [[3, 8, 20, 41, 7, 99], [11, 12, 13], [250, 4, 4, 4, 90, 1, 2, 3]]


def _tiny():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1)


def _greedy(client, n_new=12):
    reqs = [GenerateRequest(f"g{i}", p, SamplingParams(greedy=True, max_new_tokens=n_new)) for i, p in enumerate(PROMPTS)]
    return [r.outputs[0].output_ids for r in client.generate_many(reqs)]


def _nccl_update(fleet, client, hf, version):
    """The trainer's side of an in-memory update: rank 0 of an NCCL group with every server rank."""
    from realhf.base.network import find_free_port
    from realhf.gen_server.weight_group import WeightGroup, metas_of, send

    spec = WeightGroupSpec("127.0.0.1", find_free_port(), 0, 1 + fleet.n, "gpu-test", "nccl", 120.0)
    pending = client.submit(lambda: client.client.init_weight_group(
        [dataclasses.replace(spec, rank_offset=1 + i) for i in range(fleet.n)]))
    group = WeightGroup(spec, rank=0)
    pending.result()
    hf = {k: v.cuda() for k, v in hf.items()}
    metas = metas_of(hf)
    pending = client.submit(lambda: client.client.update_weights_from_group(metas, version))
    t = threading.Thread(target=send, args=(group, hf, metas))
    t.start()
    t.join()
    pending.result()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_vllm_server_on_cuda_greedy_and_nccl_update(tmp_path):
    import transformers

    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.model.conversion.hf_io import stage_hf_state

    path = _tiny()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    want = []
    for p in PROMPTS:
        out = hf_model.generate(torch.tensor([p]).cuda(), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        want.append(out[0, len(p):].tolist())
    with LocalFleet("vllm", path, 1, dtype="float32", device="cuda", max_model_len=256,
                    extra={"gpu_memory_utilization": 0.3}, gpus_per_server=[[0]]) as fleet:
        c = fleet.client()
        assert _greedy(c) == want
        m, _ = perturbed_model(path, tmp_path, seed=1)
        _nccl_update(fleet, c, stage_hf_state(m), 3)
        got = c.logprobs(SEQS)
        ref = sequence_logprobs(m, SEQS)
        assert max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y)) < 1e-3
        assert c.health()[0]["version"] == 3


def test_gen_server_on_cuda_matches_in_process_generation():
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    model = build_from_hf(path, grid=single_process_grid(), dtype=torch.bfloat16, device="cuda")
    # both eager: graphs replay other kernels (padded to other row counts in the server), other bf16 rounding
    ref = generate(model, PROMPTS, GenerationHyperparameters(n=2, max_new_tokens=10, cuda_graph=False), seeds=[1, 2, 3, 4])
    with LocalFleet("gen", path, 1, dtype="bfloat16", device="cuda", max_model_len=256, gpus_per_server=[[0]],
                    extra={"cuda_graph": False}) as f:
        res = f.client().generate_many([GenerateRequest(f"s{i}", p, SamplingParams(n=2, max_new_tokens=10, seed=i + 1))
                                        for i, p in enumerate(PROMPTS)])
    assert [o.output_ids for r in res for o in r.outputs] == ref.tokens


def test_gen_server_cuda_graph_step_equals_its_eager_step(tmp_path):
    """fp32: the server's decode step replayed as CUDA graphs (the batch padded to a few row counts) gives the eager
    server's samples; requests of different lengths leave the batch at different steps, so several padded row
    counts are captured and replayed. After a weight update from disk the graphs decode with the new weights."""
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    reqs = [GenerateRequest(f"s{i}", p, SamplingParams(n=3, max_new_tokens=6 + 5 * i, seed=i + 1))
            for i, p in enumerate(PROMPTS)]
    _, ppath = perturbed_model(path, tmp_path, seed=3)
    out, metrics = {}, {}
    for graphs in (False, True):
        with LocalFleet("gen", path, 1, dtype="float32", device="cuda", max_model_len=256, gpus_per_server=[[0]],
                        extra={"cuda_graph": graphs}) as f:
            c = f.client()
            out[graphs] = c.generate_many(reqs)
            metrics[graphs] = c.metrics()[0]
            if graphs:
                c.update_weights_from_disk(ppath, 1)
                after = _greedy(c)
    model = build_from_hf(ppath, grid=single_process_grid(), dtype=torch.float32, device="cuda")
    want = generate(model, PROMPTS, GenerationHyperparameters(max_new_tokens=12, greedy=True, cuda_graph=False)).tokens
    assert after == want, (after, want)
    m = metrics[True]
    print("graph server metrics:", {k: v for k, v in m.items() if k.startswith("graph") or k == "steps"})
    assert not m["graph_failed"] and m["graph_captures"] >= 2 and m["graph_replays"] > 10, m
    assert "graph_replays" not in metrics[False]
    for a, b in zip(out[False], out[True]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.output_ids == y.output_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-3


def test_gen_server_on_cuda_takes_weights_shared_by_cuda_ipc(tmp_path):
    """A trainer process on the server's GPU shares its HF tensors as CUDA IPC handles
    (realhf.gen_server.weight_share): the server, which sees that GPU, copies them device to device and then
    decodes as a model built from the same weights does; it keeps its copy when the trainer's tensors change."""
    from safetensors.torch import load_file

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.gen_server.fleet import LocalFleet
    from realhf.gen_server.weight_share import SharedWriter, device_uuid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    _, ppath = perturbed_model(path, tmp_path, seed=5)
    named = {k: v.cuda() for k, v in load_file(os.path.join(ppath, "model.safetensors")).items()}
    model = build_from_hf(ppath, grid=single_process_grid(), dtype=torch.float32, device="cuda")
    want = generate(model, PROMPTS, GenerationHyperparameters(max_new_tokens=12, greedy=True, cuda_graph=False)).tokens
    w = SharedWriter("gpu-test")
    with LocalFleet("gen", path, 1, dtype="float32", device="cuda", max_model_len=256, gpus_per_server=[[0]],
                    extra={"cuda_graph": False}) as f:
        c = f.client()
        (h,) = c.health()
        assert h["shared_weights"] and device_uuid(torch.device("cuda", 0)) in h["gpus"], h
        before = _greedy(c)
        part = w.share(named)
        assert part["device"] == "cuda" and all(b["kind"] == "cuda_ipc" for b in part["buffers"])
        (r,) = c.update_weights_from_shared([part], 1)
        print("shared update of", len(named), "tensors:", r)
        w.release()
        for t in named.values():  # the trainer moves on: the server holds its own copy
            t.zero_()
        torch.cuda.synchronize()
        after = _greedy(c)
    w.close()
    assert after == want and before != want, (before, after, want)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
def test_sglang_server_generate_logprobs_and_disk_update(tmp_path):
    from realhf.gen_server.fleet import LocalFleet

    path = _tiny()
    with LocalFleet("sglang", path, 1, dtype="float32", max_model_len=256, gpus_per_server=[[0]],
                    extra={"mem_fraction_static": 0.3}) as fleet:
        c = fleet.client()
        out = _greedy(c)
        assert [len(o) for o in out] == [12] * len(PROMPTS)
        m, mpath = perturbed_model(path, tmp_path, seed=2)
        c.update_weights_from_disk(mpath, 4)
        got = c.logprobs(SEQS)
        ref = sequence_logprobs(m, SEQS)
        assert max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y)) < 1e-3


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or torch.cuda.device_count() < 2,
                    reason="needs vllm and two GPUs")
def test_ppo_math_with_a_vllm_server_on_cuda(tmp_path):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    path = _tiny()
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="easy"), str(tmp_path / "math.jsonl"))
    p = run_quickstart(["ppo-math", f"actor.path={path}", f"dataset.path={tmp_path}/math.jsonl",
                        "dataset.train_bs_n_seqs=4", "group_size=2", "ppo.gen.max_new_tokens=6", "use_critic=false",
                        "ppo.kl_ctl=0", "ppo.ppo_n_minibatches=1", "use_chat_template=false",
                        "allocation_mode=vllm.d1m1p1+d1m1p1", "n_devices_per_node=2", "param_realloc=memory",
                        'gen_server.extra={"gpu_memory_utilization": 0.3}', "exp_ctrl.benchmark_steps=3",
                        f"fileroot={tmp_path}", "experiment_name=vllm-cuda"], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    st = read_stats(str(tmp_path), "vllm-cuda")
    assert len(st) == 3 and all(s["actor_gen/weight_sync_time"] > 0 for s in st[1:])
    assert os.path.exists(os.path.join(tmp_path, "vllm-cuda", "trial0", "logs", "gen_server_0.log"))
