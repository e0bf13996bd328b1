"""realhf against ``transformers`` on one device, in one process (``bench_scale.py --compare-transformers`` and
``--profile-decode``; formerly ``bench_gpu.py``):

* generation: tokens/s of ReaLModel ``generate`` (with and, on CUDA, without CUDA graphs of the decode step) against
  ``transformers`` ``generate`` on the same checkpoint, greedy, every row exactly ``new_tokens`` new tokens, for each
  work ``ROWSxTOKENS`` (``ROWS`` distinct prompts of ``prompt_len`` tokens) or ``PROMPTSxGROUPxTOKENS`` (a GRPO
  group: realhf decodes the group over one copy of the prompt's keys/values, transformers over repeated prompts);
* the generation server's engine (``gen`` backend, in-process, no HTTP) on the same works, its decode step replayed
  as CUDA graphs over a padded batch and eagerly (``cuda_graph`` false);
* training: one forward + backward + AdamW step of packed sequences (realhf ``TrainEngine``: bf16 parameters with
  fp32 master weights on CUDA; transformers: the same dtype, fused AdamW), tokens/s, achieved TFLOP/s
  (6 * params * tokens + causal attention) and its fraction of the measured matmul rate, for each ``BATCHxSEQLEN``;
* the peak CUDA memory of each measurement.

Each function prints JSON lines through ``out`` (a callable taking keyword figures) and returns nothing.
"""
from __future__ import annotations

import statistics
import time

import torch


class Device:
    """The device the comparisons run on, with its synchronisation and memory counters (no-ops on the CPU)."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def empty_cache(self):
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        return round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if self.cuda else None


def prompts_of(n: int, length: int, vocab: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def parse_work(w: str) -> tuple:
    parts = [int(p) for p in w.split("x")]
    if len(parts) == 2:
        return parts[0], 1, parts[1]
    if len(parts) == 3:
        return tuple(parts)
    raise ValueError(f"--gen-works item {w!r}: expected ROWSxTOKENS or PROMPTSxGROUPxTOKENS")


def _hf_generate(path, dev: Device, prompts, group, eos):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dev.dtype).to(dev.name).eval()
    ids = torch.tensor([p for p in prompts for _ in range(group)], device=dev.name)

    def run(k):
        with torch.no_grad():
            o = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=eos)
        return int((o.shape[1] - ids.shape[1]) * o.shape[0])
    return m, run


def generation(out, path: str, work: str, prompt_len: int, env, dev: Device) -> None:
    import transformers

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    n_prompts, group, new = parse_work(work)
    cfg = transformers.AutoConfig.from_pretrained(path)
    prompts = prompts_of(n_prompts, prompt_len, cfg.vocab_size)
    res = {}
    impls = ("realhf", "realhf_eager", "hf") if dev.cuda else ("realhf", "hf")  # CUDA graphs exist on CUDA only
    for impl in impls:
        dev.empty_cache()
        if impl == "hf":
            m, run = _hf_generate(path, dev, prompts, group, cfg.eos_token_id)
        else:
            m = build_from_hf(path, grid=single_process_grid(env), env=env)

            def run(k, graphs=impl == "realhf"):  # realhf_eager: without CUDA graphs of the decode step
                g = GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, greedy=True, n=group,
                                              cuda_graph=graphs)
                o = generate(m, prompts, g, eos_token_id=cfg.eos_token_id)
                return sum(len(t) for t in o.tokens)
        run(4)  # warm-up
        dev.reset_peak()
        dev.sync()
        t = time.perf_counter()
        n = run(new)
        dev.sync()
        sec = time.perf_counter() - t
        res[impl] = n / sec
        out(part="gen", work=work, impl=impl, tokens=n, seconds=round(sec, 3), tok_per_s=round(n / sec, 1),
            peak_cuda_gib=dev.peak_gib())
        del m
    from realhf.impl.model.nn import graph_decode

    out(part="gen", work=work, realhf_over_hf=round(res["realhf"] / res["hf"], 2),
        realhf_over_realhf_eager=round(res["realhf"] / res["realhf_eager"], 2) if "realhf_eager" in res else None,
        graph_stats=dict(graph_decode.STATS))


async def _serve(path, dev: Device, prompts, group, new, prompt_len, graphs):
    import asyncio

    from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams
    from realhf.gen_server.realhf_engine import RealhfEngine

    e = RealhfEngine(EngineConfig(backend="gen", model_path=path, dtype="bfloat16" if dev.cuda else None,
                                  device=dev.name, max_model_len=prompt_len + new + 8,
                                  max_num_seqs=max(256, len(prompts) * group), extra={"cuda_graph": graphs}))
    await e.start()
    try:
        runs = []
        for rep in range(2):
            reqs = [GenerateRequest(f"{rep}-{i}", p, SamplingParams(
                n=group, max_new_tokens=new, min_new_tokens=new, greedy=group == 1, temperature=1.0,
                seed=None if group == 1 else i)) for i, p in enumerate(prompts)]
            dev.sync()
            t = time.perf_counter()
            res = await asyncio.gather(*[e.generate(r) for r in reqs])
            dev.sync()
            runs.append((sum(len(o.output_ids) for r in res for o in r.outputs), time.perf_counter() - t))
        return runs, e.metrics()
    finally:
        await e.close()


def gen_server(out, path: str, work: str, prompt_len: int, dev: Device) -> None:
    """realhf's generation server engine on the same work, its decode step replayed as CUDA graphs (default) and
    eagerly (``cuda_graph`` false). Every request is sent at once; a group's samples are seeded (temperature 1) and
    every row generates exactly the work's token count. Each mode runs the work twice: the first run pays the
    captures (``cold``), the second replays them."""
    import asyncio

    import transformers

    n_prompts, group, new = parse_work(work)
    prompts = prompts_of(n_prompts, prompt_len, transformers.AutoConfig.from_pretrained(path).vocab_size)
    res = {}
    for impl, graphs in (("gen_server", True), ("gen_server_eager", False)):
        dev.empty_cache()
        dev.reset_peak()
        runs, m = asyncio.run(_serve(path, dev, prompts, group, new, prompt_len, graphs))
        (n0, s0), (n, sec) = runs
        res[impl] = n / sec
        out(part="gen_server", work=work, impl=impl, tokens=n, seconds=round(sec, 3), tok_per_s=round(n / sec, 1),
            cold_tok_per_s=round(n0 / s0, 1), peak_cuda_gib=dev.peak_gib(),
            graphs={k: v for k, v in m.items() if k.startswith("graph")}, steps=m["steps"])
    out(part="gen_server", work=work, graphs_over_eager=round(res["gen_server"] / res["gen_server_eager"], 2))


def training(out, path: str, shape: str, peak_tflops: float, env, dev: Device, steps: int = 5) -> None:
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
        dev.empty_cache()
        if impl == "hf":
            m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dev.dtype).to(dev.name).train()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True)
            x = torch.stack(ids).to(dev.name)
            n_params = sum(p.numel() for p in m.parameters())

            def step():
                m(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            m = build_from_hf(path, grid=single_process_grid(env), env=env)
            n_params = m.num_params()
            step = realhf_train_step(m, [t.to(dev.name) for t in ids])
        step()  # warm-up
        dev.reset_peak()
        ts = []
        for _ in range(steps):
            dev.sync()
            t = time.perf_counter()
            step()
            dev.sync()
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts)
        tokens = bs * seqlen
        tf = (6 * n_params * tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * seqlen * tokens) / sec / 1e12
        res[impl] = sec
        out(part="train", shape=shape, impl=impl, step_seconds=round(sec, 4), tok_per_s=round(tokens / sec),
            tflops=float(f"{tf:.4g}"), of_matmul_peak=round(tf / peak_tflops, 3), peak_cuda_gib=dev.peak_gib())
        del m
    out(part="train", shape=shape, hf_over_realhf_seconds=round(res["hf"] / res["realhf"], 2))


def profile_decode(out, path: str, rows: int, prompt_len: int, env, dev: Device, new: int = 16) -> None:
    """Where the host time of a decode step goes: each implementation generates ``new`` tokens for ``rows`` rows
    under torch.profiler; prints the ops by self CPU time and the number of host-device synchronisations."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate

    cfg = transformers.AutoConfig.from_pretrained(path)
    prompts = prompts_of(rows, prompt_len, cfg.vocab_size)
    rm = build_from_hf(path, grid=single_process_grid(env), env=env)
    _, run_hf = _hf_generate(path, dev, prompts, 1, cfg.eos_token_id)

    def run_realhf(k):
        generate(rm, prompts, GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, greedy=True),
                 eos_token_id=cfg.eos_token_id)

    for name, run in (("realhf", run_realhf), ("hf", run_hf)):
        run(4)
        for k in (new, 4 * new):  # the difference of two lengths: the time of 3 * new decode steps
            dev.sync()
            t = time.perf_counter()
            run(k)
            dev.sync()
            out(part="profile", impl=name, new_tokens=k, seconds=round(time.perf_counter() - t, 4))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
        with profile(activities=acts) as prof:
            run(new)
            dev.sync()
        ka = prof.key_averages()
        print(f"## {name}: {rows} rows x {new} new tokens")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        syncs = {e.key: e.count for e in ka if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")}
        out(part="profile", impl=name, syncs=syncs, n_ops=sum(e.count for e in ka if e.key.startswith("aten::")))


def run_parts(out, rows: list, path: str, env, dev: Device, peak_tflops: float, gen_works: str, prompt_len: int,
              train_shapes: str, skip: set) -> None:
    """Every comparison asked for (``skip``: of gen, server, train), then a summary table of ``rows`` (the figures
    ``out`` printed)."""
    works = [w for w in gen_works.split(",") if w]
    if "gen" not in skip:
        for w in works:
            generation(out, path, w, prompt_len, env, dev)
    if "server" not in skip:
        for w in works:
            gen_server(out, path, w, prompt_len, dev)
    if "train" not in skip:
        for s in filter(None, train_shapes.split(",")):
            training(out, path, s, peak_tflops, env, dev)
    print("\n| part | work | realhf | realhf, no CUDA graphs | transformers | realhf / transformers |\n"
          "| --- | --- | --- | --- | --- | --- |")
    by = {}
    for r in rows:
        if "impl" in r:
            by.setdefault((r["part"], r.get("work") or r.get("shape")), {})[r["impl"]] = r
    for (part, work), d in by.items():
        if part == "gen_server":
            print(f"| gen server | {work} | {d['gen_server']['tok_per_s']} tok/s | "
                  f"{d['gen_server_eager']['tok_per_s']} tok/s | - | - |")
        elif part == "gen":
            eager = f"{d['realhf_eager']['tok_per_s']} tok/s" if "realhf_eager" in d else "-"
            print(f"| gen | {work} | {d['realhf']['tok_per_s']} tok/s | {eager} | {d['hf']['tok_per_s']} tok/s | "
                  f"{d['realhf']['tok_per_s'] / d['hf']['tok_per_s']:.2f}x |")
        else:
            print(f"| train | {work} | {d['realhf']['step_seconds']} s, {d['realhf']['tflops']} TFLOP/s | - | "
                  f"{d['hf']['step_seconds']} s, {d['hf']['tflops']} TFLOP/s | "
                  f"{d['hf']['step_seconds'] / d['realhf']['step_seconds']:.2f}x |")
