"""Experiments: each quickstart experiment turned into an ExperimentSpec (models, layouts, dataset, DFG).

Experiments register themselves with :func:`register_experiment`; importing this package imports them.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

_EXPERIMENTS: Dict[str, Tuple[type, Callable]] = {}
_FINAL_HOOKS: Dict[str, Callable] = {}


def register_experiment(name: str, config_cls: type, build_fn: Callable):
    if name in _EXPERIMENTS:
        raise ValueError(f"experiment {name!r} registered twice")
    _EXPERIMENTS[name] = (config_cls, build_fn)


def register_final_hook(name: str, fn: Callable):
    _FINAL_HOOKS[name] = fn


def registered() -> Dict[str, type]:
    _import_all()
    return {k: v[0] for k, v in _EXPERIMENTS.items()}


def config_class(name: str) -> type:
    _import_all()
    if name not in _EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; available: {sorted(_EXPERIMENTS)}")
    return _EXPERIMENTS[name][0]


def build_spec(name: str, config):
    _import_all()
    if name not in _EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; available: {sorted(_EXPERIMENTS)}")
    return _EXPERIMENTS[name][1](config)


def final_hook(name: str) -> Callable:
    """``"<hook>:<argument>"`` -> a function of the spec."""
    _import_all()
    hook, _, arg = name.partition(":")
    if hook == "gen_merge":
        from realhf.experiments.gen_exp import merge_outputs

        return lambda spec: merge_outputs(spec, arg)
    return _FINAL_HOOKS[hook]


def _import_all():
    import realhf.experiments.gen_exp  # noqa: F401
    import realhf.experiments.ppo_math_exp  # noqa: F401
    import realhf.experiments.sft_exp  # noqa: F401
