"""``python -m realhf.apps.plan <experiment> --config X.yaml [key=value ...] [--cluster h200x8x2 | --profile]``

Estimates one step of a run without launching it: the experiment's spec is built as the quickstart builds it, its
memory plan checked (a plan that does not fit is refused with exit code 2 and the reason, as a launch would be), and
the step simulated on the cost model (:mod:`realhf.plan.simulate`): per MFC its devices, start, reallocation or
weight publication, input transfer, computation and end, then the step's time.

``--cluster DEVICExGPUSxNODES`` (e.g. ``h800x8x16``) plans for a cluster of a tabled device
(:mod:`realhf.plan.hardware`): ``n_nodes`` and ``n_devices_per_node`` are set from it, the capacity is the device's
memory. ``--profile`` (the default) plans for this machine, profiled at the actor's shape
(:mod:`realhf.plan.profile`, cached). ``--json`` prints the estimate as one JSON object instead of the table.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Optional, Sequence, Tuple

from realhf.api.quickstart import entry
from realhf.base import logging

logger = logging.getLogger("realhf.apps.plan")

USAGE = ("usage: python -m realhf.apps.plan <experiment> --config X.yaml [key=value ...] "
         "[--cluster DEVICExGPUSxNODES | --profile] [--json]")


def parse_cluster(s: str) -> Tuple[str, int, int]:
    """``h800x8x16`` -> ("h800", 8, 16): a tabled device, GPUs per node, nodes."""
    from realhf.plan.hardware import table

    m = re.fullmatch(r"([A-Za-z0-9]+?)x(\d+)x(\d+)", s.strip())
    if not m or int(m.group(2)) < 1 or int(m.group(3)) < 1:
        raise entry.ConfigError(f"--cluster {s!r}: expected DEVICExGPUS_PER_NODExNODES, e.g. h800x8x16 "
                                f"(devices: {sorted(table())})")
    dev = m.group(1).lower()
    if dev not in table():
        raise entry.ConfigError(f"--cluster {s!r}: unknown device {dev!r}; tabled: {sorted(table())}")
    return dev, int(m.group(2)), int(m.group(3))


def split_flags(argv: Sequence[str]):
    """(the quickstart's arguments, cluster string or None, as JSON)."""
    rest, cluster, as_json = [], None, False
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a == "--cluster":
            if i + 1 >= len(argv):
                raise entry.ConfigError("--cluster needs DEVICExGPUSxNODES after it, e.g. h200x8x2")
            cluster = argv[i + 1]
            next(it)
        elif a.startswith("--cluster="):
            cluster = a.split("=", 1)[1]
        elif a == "--profile":
            cluster = None
        elif a == "--json":
            as_json = True
        else:
            rest.append(a)
    return rest, cluster, as_json


def _hardware_and_capacity(cluster, cfg, spec, cfgs):
    """(Hardware, memory-plan Capacity) of a tabled cluster, or of this machine profiled at the actor's shape."""
    from realhf.plan import hardware
    from realhf.plan.cost import capacity
    from realhf.plan.fit import Capacity

    if cluster is not None:
        dev, gpus, _ = cluster
        hw = dataclasses.replace(hardware.get(dev), devices_per_node=gpus)
        return hw, Capacity("cuda", capacity(hw), f"{hw.name}: {hw.memory_bytes / 2**30:.1f} GiB per GPU")
    from realhf.experiments.memory_plan import capacity as run_capacity
    from realhf.plan.profile import hardware as hw_of, profile

    import torch

    trained = next((m for m in spec.models if m.optimizer is not None and m.name in cfgs), None)
    shape = cfgs[trained.name] if trained is not None else next(iter(cfgs.values()))
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    torch.set_num_threads(max(1, spec.threads_per_worker))  # a worker's share of the host, as the run has it
    return hw_of(profile(shape, dtype, comm=spec.n_workers > 1)), run_capacity(cfg, spec)


def _is_auto(cfg, mfc_name: str) -> bool:
    """Whether the config leaves MFC ``mfc_name``'s micro-batch budget to the memory plan (``auto``)."""
    section = getattr(cfg, mfc_name, None)
    mb = getattr(section, "mb_spec", None) if section is not None else getattr(cfg, "mb_spec", None)
    return mb is not None and mb.max_tokens_per_mb == "auto"


def with_prompt_len(work, bound: int, prompt_len: float):
    """``work`` (the MFCs' workloads, sized for prompts of ``bound`` tokens) for prompts of ``prompt_len`` tokens."""
    out = {}
    for k, w in work.items():
        seq = prompt_len if w.kind == "generate" else w.seq_len - bound + prompt_len
        out[k] = dataclasses.replace(w, seq_len=max(1, int(math.ceil(seq))))
    return out


def estimate(name: str, cfg, cluster: Optional[Tuple[str, int, int]] = None, prompt_len: Optional[float] = None):
    """(StepEstimate, memory plan) of experiment ``name`` under ``cfg``; raises ValueError (the memory plan's
    refusal) when the plan does not fit. ``prompt_len``: the prompts' mean length in tokens (default: the bound the
    config sets, ``dataset.max_prompt_len``, as the memory plan takes it)."""
    from realhf.experiments import build_spec
    from realhf.experiments.memory_plan import model_configs, plan_run, workloads
    from realhf.plan.fit import auto_budget, plan, refusal
    from realhf.plan.simulate import plan_of, simulate_step

    if cluster is not None:
        cfg.n_devices_per_node, cfg.n_nodes = cluster[1], cluster[2]
        spec = build_spec(name, cfg)
        cfgs = model_configs(spec)
        hw, cap = _hardware_and_capacity(cluster, cfg, spec, cfgs)
        work = {k: v for k, v in workloads(cfg).items() if k in {f.name for f in spec.mfcs}}
        budgets = {f.name: auto_budget(spec, cfgs, work, cap, f.name) for f in spec.mfcs
                   if f.name in work and _is_auto(cfg, f.name)}
        mem = plan(spec, cfgs, work, cap, budgets)
        bad = mem.unfit()
        if bad:
            from realhf.experiments.memory_plan import mfc_config_key

            raise ValueError(refusal(bad[0], cap, mfc_config_key(cfg, bad[0].mfc)))
        device = "cuda"
    else:
        cfg, spec, mem = plan_run(name, cfg, lambda c: build_spec(name, c))
        cfgs = model_configs(spec)
        hw, _ = _hardware_and_capacity(None, cfg, spec, cfgs)
        work, budgets = workloads(cfg), None
        device = hw.device
    if prompt_len is not None and hasattr(cfg.dataset, "max_prompt_len"):
        work = with_prompt_len(work, cfg.dataset.max_prompt_len, prompt_len)
    return simulate_step(plan_of(spec, cfgs, work, device, budgets), hw), mem


def main(argv=None) -> int:
    from realhf.experiments import registered
    from realhf.impl.dataset import DatasetError

    registered()  # imports (and so registers) every experiment
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        rest, cluster_s, as_json = split_flags(argv)
        if not rest or rest[0] in ("-h", "--help"):
            sys.stdout.write(__doc__ + "\n" + USAGE + "\n")
            return 0 if rest else 2
        cluster = parse_cluster(cluster_s) if cluster_s is not None else None
        name, cfg = entry.parse_cli(rest)
        logging.getLogger("realhf").setLevel("WARNING")
        est, mem = estimate(name, cfg, cluster)
    except entry.HelpRequested as h:
        sys.stdout.write(h.text)
        return 0
    except (entry.ConfigError, ValueError, KeyError, FileNotFoundError, DatasetError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.stderr.write(f"error: {msg}\n")
        return 2
    if as_json:
        sys.stdout.write(json.dumps(est.as_dict()) + "\n")
        return 0
    sys.stdout.write(est.table() + "\n")
    if mem is not None:
        sys.stdout.write(mem.table() + "\n")
    return 0


if __name__ == "__main__":
    from realhf.base.process import exit_done

    exit_done(main())
