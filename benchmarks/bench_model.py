"""Model-layer benchmark: ReaLModel vs transformers on the same checkpoint, in one run.

Prints JSON lines:
  * matmul peak of this machine in ``--dtype`` (GFLOP/s of a 2048^2 product with each CPU GEMM kernel:
    aten/MKL, oneDNN, oneDNN on a packed weight; the best is the peak)
  * generation: tokens/s of ReaLModel ``generate`` vs ``transformers`` ``generate`` (greedy,
    ``--n-prompts`` chat prompts x ``--new-tokens`` new tokens, same dtype), and their ratio; realhf runs
    with the CPU GEMM kernel it chooses (``realhf``) and with aten's forced (``realhf_aten``); the GEMM
    floor takes the fastest kernel. ``--group G``: ``--n-prompts`` rows as ``G`` samples of each of
    ``n-prompts / G`` prompts (a GRPO group's work), where realhf also runs with every sample decoding over its
    own copy of its prompt's keys/values (``realhf_unshared``); ``realhf_torch_attention``: attention over the
    cache by PyTorch ops instead of the C++ kernel (csrc/decode_attention); ``--prompt-source`` picks short questions, GSM8K
    questions or GSM8K questions after four worked examples. ``realhf_paired``: realhf with the GEMM floor of each
    forward pass run right after it in the same process (prefill, then every decode step), so the machine's slow
    spells hit both alike; its ``fraction_of_floor`` needs no separate ``gemm_floor`` process
  * training: tokens/s and achieved FLOP/s (6 * params * tokens + attention) of one fwd+bwd+AdamW
    step, as a fraction of the measured matmul peak, for both implementations
  * peak memory (max RSS) of each measurement, each run in its own fresh process
  * ``--decode-split``: where a decode step of ``--n-prompts`` rows goes at given cache positions: the whole step,
    the same with attention by PyTorch ops instead of the C++ kernel, the step without attention over the cache (the new keys/values still written), without the writes either,
    and the GEMM floor of one step; the bytes of keys/values attention reads per step and the rate it reads them

Usage: python benchmarks/bench_model.py [--model smollm2|tiny-llama] [--dtype float32] [--skip gen|train]
       python benchmarks/bench_model.py --skip train --n-prompts 64 --group 8 --prompt-source gsm8k-4shot \
           --new-tokens 64 --gen-impls realhf,gemm_floor
       python benchmarks/bench_model.py --decode-split [--positions 50,100,200]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

from _timing import emit as _emit


def _model_path(name: str, dtype: str) -> str:
    if name == "smollm2":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="float32")
    from realhf.impl.model.tiny import ensure_tiny_model

    return ensure_tiny_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4)


def _prompts(path, n, source="apples"):
    """``n`` chat prompts: short addition questions (``apples``), the first GSM8K train questions (``gsm8k``), or
    GSM8K train questions after four worked examples (``gsm8k-4shot``, ~600 tokens each)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if source.startswith("gsm8k"):
        import json

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, "realhf", "data", "gsm8k", "train.jsonl")) as f:
            rows = [json.loads(line) for _, line in zip(range(n + 4), f)]
        shots = ""
        if source == "gsm8k-4shot":  # four worked examples before each question: a long prompt shared by a group
            shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:4])
            rows = rows[4:]
        questions = [shots + (f"Question: {r['question']}\nAnswer:" if shots else r["question"]) for r in rows[:n]]
    else:
        questions = [
            f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?" for a, b in
            [(3, 5), (12, 7), (21, 9), (4, 30), (15, 15), (8, 13), (27, 2), (11, 19)]
        ]
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": questions[i % len(questions)] + " " * (i // len(questions))}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out, tok


def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _set_kernel(impl) -> dict:
    """Apply the CPU settings of a realhf worker and return them (``gemm_kernel``, ``malloc``): ``realhf``: the
    GEMM kernel realhf chooses and freed host memory kept for reuse (``realhf.base.host_memory``), as a model
    worker runs; ``realhf_aten``: the same with aten's (MKL) GEMM forced; ``realhf_glibc_malloc``: realhf's
    kernel with glibc's default malloc."""
    import os

    from realhf.base import host_memory
    from realhf.impl.model.nn import cpu_gemm

    if impl == "realhf_glibc_malloc":
        os.environ[host_memory.ENV_VAR] = "default"
    retained = host_memory.retain_freed_memory()
    return {"gemm_kernel": cpu_gemm.set_kernel("aten" if impl == "realhf_aten" else None),
            "malloc": "retain" if retained else "default"}


def gen_worker(impl, path, dtype_name, n_prompts, new_tokens, group, source, q):
    """Generation of ``n_prompts`` rows: ``n_prompts // group`` distinct prompts with ``group`` greedy samples each
    (identical samples, but each row decodes: the work of a GRPO group). ``realhf_unshared`` runs realhf with every
    sample decoding over its own copy of the prompt's keys/values (as before ``SharedPrefixCache``)."""
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype_name)
    prompts, tok = _prompts(path, n_prompts // group, source)
    if impl == "gemm_floor":
        # The GEMMs alone that any implementation runs for this work: prefill of the packed prompts, then
        # one sweep over the weights per new token with one row per sample.
        import transformers

        from _timing import gemm_sweep_seconds, linear_weights

        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt)
        groups = linear_weights(m)
        prefill = gemm_sweep_seconds(groups, sum(len(p) for p in prompts), repeats=1)
        decode = gemm_sweep_seconds(groups, len(prompts) * group, repeats=5)
        decode_lib = gemm_sweep_seconds(groups, len(prompts) * group, repeats=5, own_kernel=False)
        n = len(prompts) * group * new_tokens
        dt_s = prefill + new_tokens * decode
        q.put(dict(impl=impl, tokens=n, seconds=round(dt_s, 3), tok_per_s=round(n / dt_s, 1),
                   prefill_gemm_seconds=round(prefill, 3), decode_step_gemm_ms=round(decode * 1e3, 2),
                   decode_step_gemm_ms_pytorch_kernels=round(decode_lib * 1e3, 2),
                   peak_rss_mb=round(_peak_mb())))
        return
    paired = None  # realhf_paired: the floors timed beside realhf's passes (_PairedFloor)
    if impl == "hf":
        import transformers

        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt)
        tok.padding_side = "left"
        batch = tok.pad({"input_ids": [p for p in prompts for _ in range(group)]}, return_tensors="pt")

        def run(k):
            with torch.no_grad():
                o = m.generate(**batch, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                               pad_token_id=tok.pad_token_id)
            return int((o.shape[1] - batch["input_ids"].shape[1]) * o.shape[0])
    else:
        from realhf.api.core.model_api import GenerationHyperparameters
        from realhf.base.topology import single_process_grid
        from realhf.impl.model.conversion.hf_io import build_from_hf
        from realhf.impl.model.nn.generation import generate

        settings = _set_kernel(impl)
        if impl == "realhf_unshared":
            from realhf.impl.model.nn import generation

            generation._share_prefixes = lambda *args: False
        if impl == "realhf_torch_attention":  # attention over the cache by PyTorch ops, not the C++ kernel
            from realhf.impl.model.nn import kv_cache

            kv_cache.decode_kernel = lambda: None
        if impl == "realhf_torch_ops":  # the decode step's GEMMs, norms, rotary and SiLU by PyTorch, not decode_ops
            from realhf.impl.model.nn import decode_ops

            decode_ops.enabled = lambda: False

        model = build_from_hf(path, grid=single_process_grid(), dtype=dt)

        kv = "float16" if impl == "realhf_kv16" else "auto"  # an fp16 KV cache (kv_cache_dtype)
        paired = _PairedFloor(path, dt) if impl == "realhf_paired" else None

        def run(k):
            g = GenerationHyperparameters(max_new_tokens=k, min_new_tokens=k, greedy=True, n=group, kv_cache_dtype=kv)
            out = generate(model, prompts, g, eos_token_id=tok.eos_token_id)
            return sum(len(t) for t in out.tokens)

    run(4)  # warm-up
    if paired is not None:
        paired.reset()
    t = time.perf_counter()
    n = run(new_tokens)
    dt_s = time.perf_counter() - t
    r = dict(impl=impl, tokens=n, seconds=round(dt_s, 3), tok_per_s=round(n / dt_s, 1), peak_rss_mb=round(_peak_mb()))
    if impl != "hf":
        r.update(settings)
    if paired is not None:  # realhf's time without the floors run beside its forward passes
        r.update(paired.figures(n, dt_s))
    q.put(r)


class _PairedFloor:
    """``realhf_paired``: after every forward pass of a ReaLModel in this process, the GEMM floor of that pass (the
    fastest sweep of ``_timing.fastest_sweep`` over the same number of rows, chosen at the first pass of that size,
    outside the timed pair) runs and both are timed, so a slow spell of the machine hits the work and its floor
    alike."""

    def __init__(self, path, dt):
        import torch
        import transformers

        from _timing import fastest_sweep, linear_weights
        from realhf.impl.model.nn import real_model

        self.no_grad, self.fastest_sweep = torch.no_grad, fastest_sweep  # (looked up once, not in every pass)
        self.groups = linear_weights(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt))
        self.sweeps = {}
        self.reset()
        forward = real_model.ReaLModel.__call__
        real_model.ReaLModel.__call__ = lambda model, x, inp: self._pair(forward, model, x, inp)

    def reset(self):
        """Forget the passes so far (the warm-up's)."""
        self.fwd, self.floor, self.rows = [], [], []
        self.pause = 0.0  # seconds spent on floors and on choosing them: not realhf's time

    def _pair(self, forward, model, x, inp):
        t0 = time.perf_counter()
        y = forward(model, x, inp)
        t1 = time.perf_counter()
        rows = x.shape[0]
        with self.no_grad():
            if rows not in self.sweeps:
                self.sweeps[rows] = self.fastest_sweep(self.groups, rows)
            t2 = time.perf_counter()
            self.sweeps[rows]()
        t3 = time.perf_counter()
        self.fwd.append(t1 - t0)
        self.floor.append(t3 - t2)
        self.rows.append(rows)
        self.pause += t3 - t1
        return y

    def figures(self, n_tokens: int, wall_s: float) -> dict:
        """The figures of the passes since :meth:`reset`, for ``n_tokens`` generated in ``wall_s`` seconds (floors
        included); ``seconds``: realhf's time alone. The decode steps are the passes of the last pass's size."""
        floor_s, own_s = sum(self.floor), wall_s - self.pause
        decode = [(f, g) for f, g, r in zip(self.fwd, self.floor, self.rows) if r == self.rows[-1]]
        return dict(seconds=round(own_s, 3), tok_per_s=round(n_tokens / own_s, 1), floor_seconds=round(floor_s, 3),
                    floor_tok_per_s=round(n_tokens / floor_s, 1), fraction_of_floor=round(floor_s / own_s, 3),
                    prefill_seconds=round(self.fwd[0], 3), prefill_floor_seconds=round(self.floor[0], 3),
                    decode_forward_ms=round(statistics.median(f for f, _ in decode) * 1e3, 2),
                    decode_floor_ms=round(statistics.median(g for _, g in decode) * 1e3, 2),
                    decode_forward_over_floor_per_step=round(statistics.median(f / g for f, g in decode), 3))


def train_worker(impl, path, dtype_name, bs, seqlen, steps, q):
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype_name)
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    V = cfg.vocab_size
    ids = [torch.randint(0, V, (seqlen,)) for _ in range(bs)]
    if impl == "hf":
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt)
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True)
        x = torch.stack(ids)
        n_params = sum(p.numel() for p in m.parameters())

        def step():
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        settings = _set_kernel(impl)
        from _timing import realhf_train_step
        from realhf.base.topology import single_process_grid
        from realhf.impl.model.conversion.hf_io import build_from_hf

        model = build_from_hf(path, grid=single_process_grid(), dtype=dt)
        n_params = model.num_params()
        step = realhf_train_step(model, ids)
    step()  # warm-up
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    sec = statistics.median(ts)
    tokens = bs * seqlen
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    flops = 6 * n_params * tokens + 6 * L * H * seqlen * tokens  # matmuls + causal attention (fwd+bwd)
    extra = {} if impl == "hf" else settings
    q.put(dict(impl=impl, tokens=tokens, step_seconds=round(sec, 3), tok_per_s=round(tokens / sec, 1),
               gflops=round(flops / sec / 1e9, 1), params=n_params, peak_rss_mb=round(_peak_mb()), **extra))


def decode_split_worker(path, dtype_name, rows, positions, q):
    """Median decode-step times (ms) of ``rows`` rows whose caches hold about ``positions`` positions: ``full`` (every
    block in one C++ call, DecodeLayers, where decode_block serves), ``per_layer`` (one decode_block call per block),
    ``by_op`` (the block op by op: the C++ ops and attention called
    from Python; every variant below runs this way too), ``torch_attention`` (attention by PyTorch ops, not the C++
    kernel), ``torch_ops`` (decode_ops off), then
    with attention over the cache replaced by its input (``no_attention``: the keys/values still written), then
    without the writes either (``no_cache``); the variants alternate, 3 rounds of 50 steps each."""
    import torch

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn import cpu_gemm
    from realhf.impl.model.nn.kv_cache import KVCache
    from realhf.impl.model.nn.real_model import PackedInput

    settings = _set_kernel("realhf")
    dt = getattr(torch, dtype_name)
    m = build_from_hf(path, grid=single_process_grid(), dtype=dt)
    cfg = m.config
    g = torch.Generator().manual_seed(0)
    full_attention = KVCache.decode_attention

    def no_attention(self, layer, q_, k, v, scale):
        rows_, _, _ = self._step_mask()
        self.k[layer][rows_, :, self.lens] = k
        self.v[layer][rows_, :, self.lens] = v
        return q_

    from realhf.impl.model.nn import kv_cache as kvc

    kernel_fn = kvc.decode_kernel

    def torch_attention(self, layer, q_, k, v, scale):  # the PyTorch path instead of the C++ kernel
        kvc.decode_kernel = lambda: None
        try:
            return full_attention(self, layer, q_, k, v, scale)
        finally:
            kvc.decode_kernel = kernel_fn

    from realhf.impl.model.nn import decode_ops

    ops_on = decode_ops.enabled

    def torch_ops(self, layer, q_, k, v, scale):  # marker: the whole step runs with decode_ops off (below)
        return full_attention(self, layer, q_, k, v, scale)

    from realhf.impl.model.nn import real_model

    whole_block, stack = real_model._block_decode_whole, real_model._decode_layers_whole
    variants = {"full": full_attention, "per_layer": full_attention, "by_op": full_attention,
                "torch_attention": torch_attention, "torch_ops": torch_ops, "no_attention": no_attention,
                "no_cache": lambda self, layer, q_, k, v, scale: q_}
    out = []
    for P in positions:
        cache = KVCache(m.n_local_layers, rows, P + 64, m.n_local_kv_heads, cfg.head_dim, dt, "cpu")
        for t in cache.k + cache.v:
            t[:, :, :P].normal_(generator=g)
        cache.lens = torch.randint(max(P - 16, 1), P + 1, (rows,), generator=g)
        cache.decoding = True
        tok = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        times = {k: [] for k in variants}
        try:
            with torch.no_grad(), cpu_gemm.packed_weights():
                for _ in range(3):
                    for name, fn in variants.items():
                        KVCache.decode_attention = fn
                        decode_ops.enabled = (lambda: False) if name == "torch_ops" else ops_on
                        real_model._block_decode_whole = (whole_block if name in ("full", "per_layer")
                                                          else (lambda *a: None))
                        real_model._decode_layers_whole = stack if name == "full" else (lambda *a: None)
                        for i in range(50):
                            inp = PackedInput(cu_seqlens=torch.arange(rows + 1, dtype=torch.int32), max_seqlen=1,
                                              position_ids=cache.lens.clone(), cache=cache)
                            t0 = time.perf_counter()
                            m(tok, inp)
                            if i >= 5:
                                times[name].append(time.perf_counter() - t0)
                            cache._mask = None  # the same positions again (nothing advances)
        finally:
            KVCache.decode_attention = full_attention
            decode_ops.enabled = ops_on
            real_model._block_decode_whole, real_model._decode_layers_whole = whole_block, stack
        ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        kv_bytes = 2 * m.n_local_layers * m.n_local_kv_heads * cfg.head_dim * int(cache.lens.sum() + rows) * cache.k[0].element_size()
        attn_s = (ms["by_op"] - ms["no_attention"]) / 1e3
        out.append(dict(positions=P, rows=rows, step_ms=ms, kv_read_mb=round(kv_bytes / 1e6, 1),
                        attention_gb_per_s=round(kv_bytes / 1e9 / attn_s, 1) if attn_s > 0 else None, **settings))
    q.put(out)


def _in_process(fn, *args):
    """``fn(*args, q)`` in a fresh process; what it puts on ``q``. A process that dies first is reported."""
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=args + (q,))
    p.start()
    while True:
        try:
            r = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"{fn.__name__}{args[:1]} died with exit code {p.exitcode} before reporting")
    p.join()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-llama"])
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--group", type=int, default=1,
                    help="samples per prompt in generation (--n-prompts rows in all): a GRPO group's work; with > 1 "
                    "realhf also runs without shared prompt keys/values (realhf_unshared)")
    ap.add_argument("--prompt-source", default="apples", choices=["apples", "gsm8k", "gsm8k-4shot"],
                    help="generation prompts: short addition questions, GSM8K train questions, or GSM8K train "
                    "questions after four worked examples (long prompts)")
    ap.add_argument("--gen-impls", default="hf,realhf,realhf_aten,gemm_floor",
                    help="generation variants to run (hf, realhf, realhf_kv16 (an fp16 KV cache), realhf_aten, "
                         "realhf_unshared, realhf_torch_attention, realhf_torch_ops, gemm_floor, realhf_paired)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="generation: run the variants this many times in alternating order; ratios of the medians")
    ap.add_argument("--train-bs", type=int, default=8)
    ap.add_argument("--train-seqlen", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: gen,train")
    ap.add_argument("--decode-split", action="store_true", help="only the decode-step breakdown (see the docstring)")
    ap.add_argument("--positions", default="50,100,200", help="cache positions of --decode-split")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count())
    path = _model_path(a.model, a.dtype)
    if a.decode_split:
        import transformers

        from _timing import gemm_sweep_seconds, linear_weights

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype))
        floor_ms = gemm_sweep_seconds(linear_weights(hf), a.n_prompts, repeats=5) * 1e3
        library_floor_ms = gemm_sweep_seconds(linear_weights(hf), a.n_prompts, repeats=5, own_kernel=False) * 1e3
        del hf
        for r in _in_process(decode_split_worker, path, a.dtype, a.n_prompts,
                             [int(x) for x in a.positions.split(",")]):
            ms = r["step_ms"]
            _emit(bench="decode_split", model=a.model, dtype=a.dtype, gemm_floor_ms=round(floor_ms, 2),
                  gemm_floor_pytorch_kernels_ms=round(library_floor_ms, 2),
                  step_torch_ops_over_floor=round(ms["torch_ops"] / floor_ms, 2),
                  step_by_op_over_floor=round(ms["by_op"] / floor_ms, 2),
                  attention_ms=round(ms["by_op"] - ms["no_attention"], 2),
                  attention_torch_ms=round(ms["torch_attention"] - ms["no_attention"], 2),
                  cache_write_ms=round(ms["no_attention"] - ms["no_cache"], 2),
                  rest_ms=round(ms["no_cache"] - floor_ms, 2), step_over_floor=round(ms["full"] / floor_ms, 2), **r)
        return 0
    # (bf16 matmuls are ~50x slower than fp32 on CPUs without AVX-512 bf16, so only the dtype in use is measured)
    from _timing import matmul_peak_gflops

    # the machine's peak is the fastest kernel's (MKL's fp32 GEMM can be far below oneDNN's on AMD CPUs)
    peaks = matmul_peak_gflops(getattr(torch, a.dtype))
    peak = {a.dtype: peaks["best"]}
    _emit(bench="matmul_peak", n=2048, dtype=a.dtype, gflops=peaks)
    skip = set(a.skip.split(",")) - {""}
    if "gen" not in skip:
        impls = [x for x in a.gen_impls.split(",") if x]
        if a.group > 1 and "realhf" in impls and "realhf_unshared" not in impls:
            impls.append("realhf_unshared")
        rounds = []
        for rnd in range(a.rounds):  # alternating order, so that a slow spell of the machine hits both sides
            order = impls if rnd % 2 == 0 else impls[::-1]
            res = {impl: _in_process(gen_worker, impl, path, a.dtype, a.n_prompts, a.new_tokens, a.group,
                                     a.prompt_source) for impl in order}
            for r in res.values():
                _emit(bench="generate", model=a.model, dtype=a.dtype, rows=a.n_prompts, group=a.group,
                      prompt_source=a.prompt_source, new_tokens=a.new_tokens, round=rnd + 1, **r)
            rounds.append(res)
        # gemm_floor: the GEMMs alone; no implementation at equal work beats it, so floor/hf bounds any
        # speed-up over transformers on this machine. With --rounds > 1 the ratios are of the medians.
        tps = {k: statistics.median(rd[k]["tok_per_s"] for rd in rounds) for k in impls}
        if a.rounds > 1:
            _emit(bench="generate_median", rounds=a.rounds, tok_per_s=tps)
        ratios = {f"{x}_over_{y}": round(tps[x] / tps[y], 2) for x, y in
                  [("realhf", "hf"), ("realhf", "realhf_aten"), ("realhf", "realhf_unshared"),
                   ("realhf", "realhf_torch_attention"), ("gemm_floor", "hf")]
                  if x in tps and y in tps}
        for x in ("realhf", "realhf_kv16"):
            if x in tps and "gemm_floor" in tps:
                ratios[f"{x}_fraction_of_floor"] = round(tps[x] / tps["gemm_floor"], 2)
                if a.rounds > 1:
                    ratios[f"{x}_fraction_of_floor_each_round"] = [
                        round(rd[x]["tok_per_s"] / rd["gemm_floor"]["tok_per_s"], 2) for rd in rounds]
        if "realhf_paired" in impls:  # each round's floor ran beside realhf's passes, in the same process
            fr = [rd["realhf_paired"]["fraction_of_floor"] for rd in rounds]
            ratios["realhf_paired_fraction_of_floor"] = round(statistics.median(fr), 3)
            ratios["realhf_paired_fraction_of_floor_each_round"] = fr
            ratios["realhf_paired_decode_forward_over_floor"] = round(statistics.median(
                rd["realhf_paired"]["decode_forward_over_floor_per_step"] for rd in rounds), 3)
        _emit(bench="generate_ratio", **ratios)
    if "train" not in skip:
        res = {impl: _in_process(train_worker, impl, path, a.dtype, a.train_bs, a.train_seqlen, a.train_steps)
               for impl in ("hf", "realhf", "realhf_aten", "realhf_glibc_malloc")}
        for r in res.values():
            _emit(bench="train", model=a.model, dtype=a.dtype, bs=a.train_bs, seqlen=a.train_seqlen,
                  fraction_of_matmul_peak=round(r["gflops"] / peak[a.dtype], 3), **r)
        _emit(bench="train_ratio", realhf_over_hf=round(res["realhf"]["tok_per_s"] / res["hf"]["tok_per_s"], 2),
              realhf_over_realhf_aten=round(res["realhf"]["tok_per_s"] / res["realhf_aten"]["tok_per_s"], 2),
              realhf_over_realhf_glibc_malloc=round(res["realhf"]["tok_per_s"] / res["realhf_glibc_malloc"]["tok_per_s"], 2))


if __name__ == "__main__":
    sys.exit(main())
