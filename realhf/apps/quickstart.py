"""``python -m realhf.apps.quickstart <experiment> --config X.yaml key=value ...``

Every registered experiment (``realhf.experiments``) becomes a quickstart command. Config errors and
anything wrong found while building the experiment (missing files, malformed data rows, layouts that do
not fit the model, a DFG key nobody produces) are reported before any process starts, with exit code 2.
"""
from __future__ import annotations

import sys

from realhf.api.quickstart import entry
from realhf.base import logging

logger = logging.getLogger("realhf.quickstart")


def _runner(name: str):
    def run(cfg) -> int:
        from realhf.apps.main import run_experiment
        from realhf.experiments import build_spec
        from realhf.impl.dataset import DatasetError
        from realhf.scheduler import get_launcher

        try:
            launcher = get_launcher(cfg.mode)
            spec = build_spec(name, cfg)  # fail fast, with a clear message, before anything starts
            if launcher.check is not None:  # e.g. the Ray cluster must exist and hold the workers
                launcher.check(cfg, spec.n_workers)
        except (ValueError, KeyError, FileNotFoundError, DatasetError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            sys.stderr.write(f"error: {msg}\n")
            return 2
        return run_experiment(name, cfg)

    return run


def register_all():
    from realhf.experiments import registered

    have = entry.registered_experiments()
    for name, cls in registered().items():
        if name not in have:
            entry.register_quickstart_exp(name, cls, _runner(name))


def main(argv=None) -> int:
    register_all()
    return entry.main(argv)


if __name__ == "__main__":
    sys.exit(main())
