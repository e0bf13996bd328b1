"""``python -m realhf.apps.plan <experiment> --config X.yaml [key=value ...] [--cluster h200x8x2 | --profile]
[--search [--write FILE] [--seed N] [--max-evals N] [--time-limit S]] [--json]``

Estimates one step of a run without launching it: the experiment's spec is built as the quickstart builds it, its
memory plan checked (a plan that does not fit is refused with exit code 2 and the reason, as a launch would be), and
the step simulated on the cost model (:mod:`realhf.plan.simulate`): per MFC its devices, start, reallocation or
weight publication, input transfer, computation and end, then the step's time.

``--cluster DEVICExGPUSxNODES`` (e.g. ``h800x8x16``) plans for a cluster of a tabled device
(:mod:`realhf.plan.hardware`): ``n_nodes`` and ``n_devices_per_node`` are set from it, the capacity is the device's
memory; the run's model folders and data files need not be on this machine (a model folder named after a tabled
shape, e.g. ``/models/DeepSeek-R1-Distill-Qwen-7B``, or a shape's name as the path, stands for it). ``--profile``
(the default) plans for this machine, profiled at the actor's shape (:mod:`realhf.plan.profile`, cached).

``--search`` (or ``allocation_mode=search``) searches each MFC's devices, layout and micro-batches
(:mod:`realhf.plan.search`) and prints the chosen plan beside the runners-up, the best single global layout, the
``heuristic`` allocation and the config's own; ``--write FILE`` writes the chosen plan as a config
(``allocation_mode=manual``) to launch or edit. ``--json`` prints one JSON object instead of the tables.
"""
from __future__ import annotations

import json
import re
import sys
from typing import Sequence, Tuple

from realhf.api.quickstart import entry
from realhf.apps import planning
from realhf.base import logging

logger = logging.getLogger("realhf.apps.plan")

USAGE = ("usage: python -m realhf.apps.plan <experiment> --config X.yaml [key=value ...] "
         "[--cluster DEVICExGPUSxNODES | --profile] [--search [--write FILE] [--seed N] [--max-evals N] "
         "[--time-limit S]] [--json]")


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
    """(the quickstart's arguments, cluster string or None, as JSON, the search's options)."""
    rest, cluster, as_json = [], None, False
    opts = dict(search=False, write=None, seed=0, max_evals=20000, time_limit=30.0)
    kinds = {"--write": str, "--seed": int, "--max-evals": int, "--time-limit": float}
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        flag, eq, val = a.partition("=")
        if flag in ("--cluster",) + tuple(kinds):
            if not eq:
                if i + 1 >= len(argv):
                    raise entry.ConfigError(f"{flag} needs a value after it"
                                            + (", e.g. h200x8x2" if flag == "--cluster" else ""))
                val = argv[i + 1]
                next(it)
            if flag == "--cluster":
                cluster = val
                continue
            try:
                opts[flag[2:].replace("-", "_")] = kinds[flag](val)
            except ValueError:
                raise entry.ConfigError(f"{flag}={val!r}: expected a{'n integer' if kinds[flag] is int else ' number'}"
                                        if kinds[flag] is not str else f"{flag}: bad value {val!r}") from None
        elif a == "--profile":
            cluster = None
        elif a == "--json":
            as_json = True
        elif a == "--search":
            opts["search"] = True
        else:
            rest.append(a)
    return rest, cluster, as_json, opts


def _stand_ins(rest: Sequence[str]) -> dict:
    """For ``--cluster``: the run's paths that are not on this machine, each with what stands for it (a model folder:
    the tabled shape its folder is named after; a data file: nothing). The paths are read from the config the command
    line builds (:func:`entry.cli_data`): every model section's ``path`` and every dataset section's paths.
    ConfigError for a model folder that is neither here nor named after a tabled shape."""
    import os

    from realhf.api.quickstart.sections import ModelConfig
    from realhf.plan.shapes import SHAPES, shape_of_folder

    exp, data = entry.cli_data(rest)
    out: dict = {}
    for key, section, name, v in entry.leaves(exp.config_cls, data):
        if not (isinstance(v, str) and v) or os.path.exists(os.path.expanduser(v)):
            continue
        if issubclass(section, ModelConfig) and name == "path":
            shape = shape_of_folder(v)
            if shape is None:
                raise entry.ConfigError(
                    f"--cluster: {key}={v!r} is not on this machine and its folder is not named after a tabled "
                    f"shape; give {key}=<a folder with its config.json> or {key}=<shape>, one of {sorted(SHAPES)}")
            out[v] = SHAPES[shape].hf_config()
        elif "dataset" in key.split(".") and name.endswith("path"):
            out[v] = None
    return out


def main(argv=None) -> int:
    from realhf.api.quickstart.stand_ins import standing_in
    from realhf.experiments import registered
    from realhf.impl.dataset import DatasetError

    registered()  # imports (and so registers) every experiment
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        rest, cluster_s, as_json, opts = split_flags(argv)
        if not rest or rest[0] in ("-h", "--help"):
            sys.stdout.write(__doc__ + "\n" + USAGE + "\n")
            return 0 if rest else 2
        cluster = parse_cluster(cluster_s) if cluster_s is not None else None
        with standing_in(_stand_ins(rest) if cluster is not None else {}):
            name, cfg = entry.parse_cli(rest)
            logging.getLogger("realhf").setLevel("WARNING")
            opts["search"] = opts["search"] or getattr(cfg, "allocation_mode", "").strip() == "search"
            if opts["write"] and not opts["search"]:
                raise entry.ConfigError("--write FILE writes the searched plan: add --search (or allocation_mode=search)")
            if opts["search"]:
                from realhf.apps.plan_search import search_config

                found = search_config(name, cfg, cluster, seed=opts["seed"], max_evals=opts["max_evals"],
                                      time_limit_s=opts["time_limit"])
                est, mem = found.estimate, found.memory
                if opts["write"]:
                    with open(opts["write"], "w") as f:
                        f.write(entry.config_to_yaml(found.cfg))
            else:
                est, mem = planning.estimate(name, cfg, cluster)
    except entry.HelpRequested as h:
        sys.stdout.write(h.text)
        return 0
    except (entry.ConfigError, ValueError, KeyError, FileNotFoundError, DatasetError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.stderr.write(f"error: {msg}\n")
        return 2
    if as_json:
        out = est.as_dict() if est is not None else {}
        if opts["search"]:
            out["search"] = (found.result.as_dict(found.backend) if found.estimate is None
                             else found.result.as_dict())
            out["options"] = found.options
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    if opts["search"]:
        sys.stdout.write(found.report() + "\n")
        if opts["write"]:
            sys.stdout.write(f"# written: {opts['write']} (launch it with --config {opts['write']})\n")
    if est is not None:
        sys.stdout.write(est.table() + "\n")
    if mem is not None:
        sys.stdout.write(mem.table() + "\n")
    return 0


if __name__ == "__main__":
    from realhf.base.process import exit_done

    exit_done(main())
