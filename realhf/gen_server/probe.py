"""A generation server's own cost, measured for the planner (:mod:`realhf.plan.profile` takes it as its
``server_probe``): what a generation served by a real ``gen`` server process takes beyond the cost model's passes —
the requests, the server's scheduling, its first decoding after new weights."""
from __future__ import annotations

import statistics
import time
from typing import Tuple

from realhf.api.core.model_api import ReaLModelConfig
from realhf.plan.hardware import Hardware


def served_generate_overhead(cfg: ReaLModelConfig, hw: Hardware, dtype: str, device: str, layout_s: float = 0.0,
                             reps: int = 5) -> Tuple[float, dict]:
    """(seconds a generation served by a ``gen`` server spends beside its prefill and decode steps, the figures
    behind it): a real server process on this machine (:class:`realhf.gen_server.fleet.LocalFleet`, the calling
    process's threads) serving ``cfg`` (a small model, saved as a HF folder) takes new weights from disk, as it does
    before every step's generation in a run, then gets the probe's prompts as a run's worker sends them (one request
    per prompt, its answers together, each of exactly ``PROBE_ANSWER_LEN`` tokens); the median of the requests'
    time less the cost model's passes on ``hw`` and ``layout_s`` (the weights' layout for the decode kernel, counted
    apart), at least 0."""
    import os
    import tempfile

    import torch

    from realhf.base.topology import single_process_grid
    from realhf.gen_server.api import GenerateRequest, SamplingParams
    from realhf.gen_server.fleet import LocalFleet
    from realhf.impl.model.conversion.hf_io import save_hf
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.plan.interface_probe import (PROBE_ANSWER_LEN, PROBE_GROUP, PROBE_PROMPT_LEN, PROBE_PROMPTS,
                                             generation_passes)

    m = ReaLModel(cfg, grid=single_process_grid(), dtype=getattr(torch, dtype), device="cpu")
    m.init_random(seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (PROBE_PROMPT_LEN,), generator=g).tolist()
               for _ in range(PROBE_PROMPTS)]
    A = PROBE_ANSWER_LEN
    with tempfile.TemporaryDirectory(prefix="realhf-server-probe-") as d:
        path = os.path.join(d, "model")
        save_hf(m, path)
        del m
        with LocalFleet("gen", path, 1, dtype=dtype, device=device, threads=torch.get_num_threads(),
                        log_dir=os.path.join(d, "logs")) as fleet:
            client = fleet.client()
            version = 0

            def call():
                nonlocal version
                version += 1
                client.update_weights_from_disk(path, version)
                reqs = [GenerateRequest(f"probe{version}-{i}", p, SamplingParams(
                    n=PROBE_GROUP, temperature=1.0, min_new_tokens=A, max_new_tokens=A, seed=100 + i))
                    for i, p in enumerate(prompts)]
                t = time.perf_counter()
                client.generate_many(reqs)
                return time.perf_counter() - t

            for _ in range(2):  # warm-up: the server's first requests build its kernels and caches
                call()
            measured = statistics.median(call() for _ in range(reps))
    passes = generation_passes(cfg, hw, dtype)
    return max(0.0, measured - passes - layout_s), dict(measured_s=measured, passes_s=passes, layout_s=layout_s)
