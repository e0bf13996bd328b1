"""The cost model (``realhf.plan.cost``) against the real ReaLModel on this machine, in one process.

For each model (``tiny``: the tests' tiny Qwen2 shape; ``smollm2``: SmolLM2-135M's shape; random weights, no
checkpoint needed) it profiles this machine at the model's shape (``realhf.plan.profile``: cached after the first
run), then times, in this process, a forward pass (log-probs of packed sequences), a training step (forward, backward,
AdamW: ``_timing.realhf_train_step``) and a greedy generation of exactly N new tokens, and prints one JSON line per
work: the cost model's prediction, the measured time (the median of ``--reps`` runs, as the profile times its
kernels), and predicted / measured.

Usage: python benchmarks/bench_cost_model.py [--models tiny,smollm2] [--threads 1] [--reps 3] [--refresh]
"""
from __future__ import annotations

import argparse
import time

import torch

from _timing import emit


def _cfg(name: str):
    from realhf.plan.shapes import config_from_hf_dict, model_config

    if name == "tiny":
        from realhf.impl.model.tiny import VOCAB_MULTIPLE, BPE_VOCAB_SIZE, tiny_hf_config

        vocab = -(-BPE_VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return config_from_hf_dict(tiny_hf_config("qwen2", vocab).to_dict())
    return model_config({"smollm2": "smollm2-135m"}.get(name, name))


def _median(fn, reps: int) -> float:
    import statistics

    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def works(name: str):
    """(work, kwargs) pairs measured for a model: bigger works for the bigger model."""
    if name == "tiny":
        return [("forward", dict(seqs=4, seq_len=128)), ("forward", dict(seqs=8, seq_len=512)),
                ("train", dict(seqs=4, seq_len=128)), ("train", dict(seqs=8, seq_len=256)),
                ("generate", dict(prompts=8, prompt_len=32, new=64)), ("generate", dict(prompts=32, prompt_len=32, new=128))]
    return [("forward", dict(seqs=2, seq_len=256)), ("forward", dict(seqs=4, seq_len=256)),
            ("train", dict(seqs=2, seq_len=128)), ("train", dict(seqs=4, seq_len=128)),
            ("generate", dict(prompts=8, prompt_len=32, new=32)), ("generate", dict(prompts=16, prompt_len=32, new=16))]


def run_model(name: str, reps: int, refresh: bool):
    from _timing import realhf_train_step
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.nn.real_model import ReaLModel, make_packed_input
    from realhf.plan import profile
    from realhf.plan.cost import CostModel
    from realhf.plan.shapes import n_params

    cfg = _cfg(name)
    prof = profile.profile(cfg, "float32", "cpu", comm=False, refresh=refresh)
    cm = CostModel(cfg, profile.hardware(prof), "float32")
    model = ReaLModel(cfg, grid=single_process_grid(), dtype=torch.float32, device="cpu")
    model.init_random(seed=1)
    V = cfg.vocab_size
    train_steps = {}
    for work, kw in works(name):
        if work == "forward":
            T = kw["seqs"] * kw["seq_len"]
            inp = make_packed_input([kw["seq_len"]] * kw["seqs"])
            x = torch.randint(0, V, (T,))

            def fn():
                with torch.no_grad():
                    model(x, inp)

            pred = cm.forward(T, 1, kw["seq_len"])
        elif work == "train":
            T = kw["seqs"] * kw["seq_len"]
            ids = [torch.randint(0, V, (kw["seq_len"],)) for _ in range(kw["seqs"])]
            key = (kw["seqs"], kw["seq_len"])
            fn = train_steps.setdefault(key, realhf_train_step(model, ids))
            pred = cm.train(T, 1, kw["seq_len"]) + cm.optimizer_step(n_params(cfg))
        else:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, V, (kw["prompt_len"],), generator=g).tolist() for _ in range(kw["prompts"])]
            gc = GenerationHyperparameters(max_new_tokens=kw["new"], min_new_tokens=kw["new"], greedy=True)

            def fn():
                generate(model, prompts, gc)

            pred = cm.generate(kw["prompts"], kw["prompt_len"], 1, kw["new"])
        meas = _median(fn, reps)
        emit(model=name, work=work, **kw, predicted_s=round(pred, 4), measured_s=round(meas, 4),
             ratio=round(pred / meas, 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (a model worker's share of the cores)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--refresh", action="store_true", help="profile this machine again")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    from realhf.base.host_memory import retain_freed_memory

    retain_freed_memory()  # as a model worker does
    for name in a.models.split(","):
        run_model(name.strip(), a.reps, a.refresh)


if __name__ == "__main__":
    main()
