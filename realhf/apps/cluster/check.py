"""``python -m realhf.apps.check_cluster``: what a run will see on its nodes, checked before a long job is submitted.

Two ways to call it::

    python -m realhf.apps.check_cluster --mode slurm --nodes 4 --gpus-per-node 8 --fileroot /shared/realhf \\
        --partition gpu --account myproj
    python -m realhf.apps.check_cluster --config x.yaml --exp ppo-math [key=value ...]   # the run's own options

One probe runs on every node the run would use (``local``: in this process; ``ray``: one task per alive node of the
cluster at ``--ray-address``, pinned with ``NodeAffinitySchedulingStrategy``; ``slurm``: one
``srun --nodes=N --ntasks-per-node=1`` step running this module with ``--probe``). Each probe reports its node
(hostname, the IP a run's processes bind there, i.e. ``REALHF_HOST``, CPUs, GPUs, free memory, python/torch/realhf
versions) and checks, through ``<fileroot>/.check_cluster/<session>/``:

* that ``fileroot`` is writable there (it holds logs, checkpoints and the name-resolve directory the processes of a
  run find each other through);
* that it is shared: each node writes a token file and reads back every node's token;
* that ports are reachable: each node listens on a TCP port of its IP, publishes ``host:port`` in the shared folder,
  and connects to every node's port (the listener answers with its node's token, so a wrong process cannot pass).

The table ends with a verdict: exit 0 when the run's needs are met (enough nodes, GPUs per node, shared fileroot,
ports), exit 1 with one sentence per problem saying what to fix. ``--json`` prints the report as JSON instead.
Every wait is bounded (``--timeout`` for the probes, ``--alloc-timeout`` for Slurm to start the step, a connect
timeout for Ray), so an unreachable cluster ends with a message, never a hang.

This module is the command line (``realhf.apps.check_cluster`` runs its :func:`cli`); the parts live beside it and are
re-exported here: ``probe`` (what one node reports, the probe), ``collect`` (running the probe on every node per
launcher) and ``report`` (the request, the verdict, the table).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from realhf.apps.cluster.collect import collect, collect_local, collect_ray, collect_slurm, slurm_command
from realhf.apps.cluster.probe import PROBE_TAG, SESSION_DIR, host_address, node_info, probe, session_dir
from realhf.apps.cluster.report import Report, Request, format_report, judge, request_from_config

__all__ = ["PROBE_TAG", "SESSION_DIR", "MODES", "node_info", "host_address", "session_dir", "probe", "Request",
           "Report", "request_from_config", "collect", "collect_local", "collect_ray", "collect_slurm",
           "slurm_command", "judge", "format_report", "build_request", "main", "cli"]

MODES = ("local", "ray", "slurm")


# ----------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m realhf.apps.check_cluster",
                                 description="Check what a run will see on its nodes (nodes, CPUs, GPUs, a shared "
                                             "writable fileroot, reachable ports) before submitting it.")
    ap.add_argument("--mode", choices=MODES, help="launcher to check (default: the config's, else local)")
    ap.add_argument("--nodes", type=int, help="nodes the run needs (n_nodes)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs each node must have (default 0, or from the config)")
    ap.add_argument("--fileroot", help="the run's fileroot (must be shared by every node)")
    ap.add_argument("--ray-address", help="mode=ray: host:port of the Ray head (or 'auto')")
    ap.add_argument("--partition", help="mode=slurm: partition (srun --partition)")
    ap.add_argument("--account", help="mode=slurm: account (srun --account)")
    ap.add_argument("--config", help="take the options from this experiment config (with --exp and key=value ...)")
    ap.add_argument("--exp", help="the experiment of --config, e.g. ppo-math")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds the probes wait for each other (default 60)")
    ap.add_argument("--alloc-timeout", type=float, default=60.0,
                    help="mode=slurm: seconds Slurm may take to start the probe step (srun --immediate; default 60)")
    ap.add_argument("--connect-timeout", type=float, default=30.0,
                    help="mode=ray: seconds to join the cluster (default 30)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    # internal: one node's probe (run by the srun step)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--session", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--host-cmd", default="", help=argparse.SUPPRESS)
    return ap


def build_request(a) -> Request:
    if a.config:
        if not a.exp:
            raise ValueError("--config needs --exp <experiment>, e.g. --exp ppo-math")
        req = request_from_config(a.exp, a.config, a.overrides)
    else:
        if a.overrides:
            raise ValueError(f"key=value overrides ({' '.join(a.overrides)}) need --config x.yaml --exp <experiment>")
        if a.exp:
            raise ValueError("--exp needs --config x.yaml")
        from realhf.api.quickstart.config import _default_fileroot

        req = Request(fileroot=_default_fileroot())
    for key in ("mode", "nodes", "gpus_per_node", "fileroot", "ray_address", "partition", "account"):
        if getattr(a, key) is not None:
            setattr(req, key, getattr(a, key))
    req.timeout, req.alloc_timeout, req.connect_timeout = a.timeout, a.alloc_timeout, a.connect_timeout
    if req.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {req.nodes}")
    if req.gpus_per_node is not None and req.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {req.gpus_per_node}")
    return req


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_intermixed_args(argv)
    if a.probe:
        if not a.fileroot or not a.session:
            ap.error("--probe needs --fileroot and --session")
        index = a.index if a.index is not None else int(os.environ.get("SLURM_PROCID", "0"))
        result = probe(a.fileroot, a.session, index, a.expect, a.timeout, host_cmd=a.host_cmd)
        sys.stdout.write(PROBE_TAG + json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0
    try:
        req = build_request(a)
    except Exception as e:  # config errors, unknown experiments: a message, exit 2 as quickstart does
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.stderr.write(f"error: {msg}\n")
        return 2
    rep = judge(collect(req))
    if a.json:
        sys.stdout.write(json.dumps(rep.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_report(rep) + "\n")
    sys.stdout.flush()
    code = 0 if rep.ok else 1
    if rep.stuck:  # a blocked client call (ray.init) would hold the interpreter's exit
        sys.stderr.flush()
        os._exit(code)
    return code


def _watchdog(seconds: float) -> None:
    """End the command with a message if it is still running after ``seconds`` (a last guard against hangs)."""

    def fire():
        sys.stderr.write(f"check_cluster: no result after {seconds:g} s; giving up (a cluster call did not return)\n")
        sys.stderr.flush()
        os._exit(1)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def cli() -> None:
    """The command line, ``python -m realhf.apps.check_cluster``: :func:`main` under a watchdog that ends the process
    if every bounded wait together still overran."""
    _args, _ = _parser().parse_known_intermixed_args()
    _watchdog(_args.timeout + _args.alloc_timeout + _args.connect_timeout + 120)
    sys.exit(main())


if __name__ == "__main__":
    cli()
