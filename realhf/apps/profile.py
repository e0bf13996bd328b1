"""Profile this machine for the step simulator and the planner: ``python -m realhf.apps.profile --model smollm2-135m``.

Runs :func:`realhf.plan.profile.profile` (the kernels' rates, the links, the fitted fixed costs) with the control
plane's probe (:func:`realhf.apps.control_probe.control_plane_costs`: a few steps of a tiny run), caches it and
prints the hardware it describes and the fitted overheads as JSON.
"""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    from realhf.plan.profile import hardware, profile

    ap = argparse.ArgumentParser(prog="python -m realhf.apps.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a shape name of realhf.plan.shapes or a model folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda where present")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of this process (a worker's share)")
    ap.add_argument("--no-comm", action="store_true", help="skip the two-process link probe")
    ap.add_argument("--refresh", action="store_true", help="measure again even when cached")
    ap.add_argument("--servers", action="store_true",
                    help="also a generation server's own cost (a server process; plans with gen. servers ask for it)")
    ap.add_argument("--rollout", action="store_true",
                    help="also the rollout side's cost per episode (a server process and a rollout manager; "
                         "asynchronous plans ask for it)")
    a = ap.parse_args(argv)
    from realhf.base.host_memory import retain_freed_memory
    from realhf.apps.control_probe import control_plane_costs

    retain_freed_memory()  # measure as a model worker runs (it keeps freed host memory for reuse)
    if a.threads is not None:
        import torch

        if a.threads < 1:
            ap.error(f"--threads={a.threads}: expected a positive number")
        torch.set_num_threads(a.threads)
    from realhf.gen_server.probe import served_generate_overhead
    from realhf.system.rollout.probe import rollout_episode_overhead

    p = profile(a.model, a.dtype, a.device, comm=not a.no_comm, refresh=a.refresh,
                control_probe=control_plane_costs,
                server_probe=served_generate_overhead if a.servers else None,
                rollout_probe=rollout_episode_overhead if a.rollout else None)
    from realhf.plan.hardware import describe

    print(json.dumps(dict(path=p["path"], **describe(hardware(p), a.dtype), overheads={
        k: v for k, v in p["overheads"].items() if not k.endswith(("points", "point"))}), indent=1))  # the CLI's output


if __name__ == "__main__":
    main()
