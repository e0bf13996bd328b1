"""Experiments: each quickstart experiment turned into an ExperimentSpec (models, layouts, dataset, DFG).

Experiments register themselves where they are defined with :func:`register_experiment` (the quickstart registry,
``realhf.api.quickstart.entry.register_quickstart_exp``: one registry serves the command line and the launch);
importing this package's functions imports them.
"""
from __future__ import annotations

from typing import Callable, Dict

from realhf.api.quickstart.entry import register_quickstart_exp as register_experiment
from realhf.api.quickstart.entry import registered_experiments

_FINAL_HOOKS: Dict[str, Callable] = {}

__all__ = ["register_experiment", "register_final_hook", "registered", "config_class", "build_spec", "final_hook"]


def register_final_hook(name: str, fn: Callable):
    _FINAL_HOOKS[name] = fn


def _experiment(name: str):
    _import_all()
    exp = registered_experiments().get(name)
    if exp is None or exp.build_fn is None:
        raise KeyError(f"unknown experiment {name!r}; available: {sorted(registered())}")
    return exp


def registered() -> Dict[str, type]:
    """name -> config class of every experiment that can be built."""
    _import_all()
    return {k: v.config_cls for k, v in registered_experiments().items() if v.build_fn is not None}


def config_class(name: str) -> type:
    return _experiment(name).config_cls


def build_spec(name: str, config):
    return _experiment(name).build_fn(config)


def final_hook(name: str) -> Callable:
    """``"<hook>:<argument>"`` -> a function of the spec."""
    _import_all()
    hook, _, arg = name.partition(":")
    if hook == "gen_merge":
        from realhf.experiments.gen_exp import merge_outputs

        return lambda spec: merge_outputs(spec, arg)
    return _FINAL_HOOKS[hook]


def _import_all():
    import realhf.experiments.dpo_exp  # noqa: F401
    import realhf.experiments.gen_exp  # noqa: F401
    import realhf.experiments.ppo_math_exp  # noqa: F401
    import realhf.experiments.rw_exp  # noqa: F401
    import realhf.experiments.sft_exp  # noqa: F401
