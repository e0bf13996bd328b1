"""``python -m realhf.apps.quickstart <experiment> --config X.yaml key=value ...``

Every registered experiment (``realhf.experiments``) becomes a quickstart command. Config errors and
anything wrong found while building the experiment (missing files, malformed data rows, layouts that do
not fit the model, a DFG key nobody produces) are reported before any process starts, with exit code 2.

``--dry-run`` prints what would be submitted (every job's command; under ``mode=slurm`` the ``sbatch`` commands with
their scripts) and starts nothing. ``-q``/``--quiet`` shows only warnings and errors; ``-v``/``--verbose`` a line per step and debug logs; by default
a live progress line on a terminal, periodic plain lines otherwise (realhf.apps.console).
"""
from __future__ import annotations

import sys

from realhf.api.quickstart import entry
from realhf.base import logging


def run(name: str, cfg, console=None, dry_run: bool = False) -> int:
    """Build experiment ``name`` from ``cfg`` (every check runs here, before anything starts: exit code 2 with the
    message) and run it through its launcher (``dry_run``: print what would be submitted, start nothing)."""
    from realhf.apps.main import check_process_env, dry_run as print_plan, run_experiment
    from realhf.apps.plan_search import resolve_search
    from realhf.experiments import build_spec
    from realhf.experiments.memory_plan import plan_run
    from realhf.impl.dataset import DatasetError
    from realhf.scheduler import get_launcher

    try:
        launcher = get_launcher(cfg.mode)
        cfg = resolve_search(name, cfg, write=not dry_run)  # allocation_mode=search: the chosen plan, as a manual allocation
        if dry_run:
            return print_plan(name, cfg)
        # fail fast, with a clear message, before anything starts; a plan that does not fit its devices is refused and
        # max_tokens_per_mb=auto becomes the budgets the processes run with
        cfg, spec, _ = plan_run(name, cfg, lambda c: build_spec(name, c))
        check_process_env()
        if launcher.check is not None:  # e.g. the Ray cluster must exist and hold the workers
            launcher.check(cfg, spec.device_slots())
    except (ValueError, KeyError, FileNotFoundError, DatasetError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.stderr.write(f"error: {msg}\n")
        return 2
    return run_experiment(name, cfg, console, spec=spec)  # the processes load this spec; nobody builds it again


def console_flags(argv):
    """(argv without the console flags, verbosity)."""
    quiet = {"-q", "--quiet"} & set(argv)
    verbose = {"-v", "--verbose"} & set(argv)
    if quiet and verbose:
        raise entry.ConfigError("choose one of --quiet and --verbose")
    rest = [a for a in argv if a not in ("-q", "--quiet", "-v", "--verbose")]
    return rest, "quiet" if quiet else "verbose" if verbose else "normal"


def launch_flags(argv):
    """(argv without ``--dry-run``, whether it was given)."""
    return [a for a in argv if a != "--dry-run"], "--dry-run" in argv


def main(argv=None) -> int:
    from realhf.apps.console import Console
    from realhf.experiments import registered

    registered()  # imports (and so registers) every experiment
    try:
        argv, verbosity = console_flags(sys.argv[1:] if argv is None else list(argv))
        argv, dry = launch_flags(argv)
    except entry.ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if verbosity != "normal":  # the launcher's own log; the processes' logs are in their files
        logging.getLogger("realhf").setLevel("WARNING" if verbosity == "quiet" else "DEBUG")
    if dry:  # the plan goes to stdout alone
        logging.getLogger("realhf").setLevel("WARNING")
    return entry.main(argv, lambda name, cfg: run(name, cfg, Console(verbosity), dry_run=dry))


if __name__ == "__main__":
    from realhf.base.process import exit_done

    exit_done(main())
