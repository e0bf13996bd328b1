"""Every option of every experiment reaches the code that uses it.

For each experiment of ``realhf.experiments.registered()`` and each option that ``config_options`` lists for
its config, the option is set to a non-default value (the tables of ``support.option_reach_tables``), the
experiment's spec is built as every process builds it (in this process, no workers), the interfaces are made as
the model workers make them (``make_interfaces``), and the value must arrive where it is used: an interface
attribute the interface computes with, a ModelSpec / MFCDef / DatasetSpec field the worker builds its model, engine
or data from, or an ExperimentSpec field the master reads. The same build without the option (only its ``needs``,
the options that make it matter) must differ there, so a check that reads a constant cannot pass.

An option with no entry fails: say where it is read, or remove it — an option nothing reads is a silent bug.
Two other kinds of entry: :class:`Launcher` (read by the launcher before any process starts, checked against
the source that reads it) and :class:`Refused` (a non-default value has no use in that experiment and is
refused with the key named).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from types import SimpleNamespace

import pytest

from realhf.base.process import source_root
from realhf.impl.model.tiny import ensure_tiny_model

from support import option_reach_tables as tables
from support.option_reach_tables import BASE_ARGS, COMMON, NEEDS, SAME, TABLES, Built, Launcher, Refused

ROOT = source_root()


def _experiments():
    from realhf.experiments import registered

    return registered()


def _cases():
    from realhf.api.quickstart.entry import config_options

    return [(exp, o.key) for exp, cls in sorted(_experiments().items()) for o in config_options(cls) if not o.is_section]


CASES = _cases()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    d = tmp_path_factory.mktemp("reach")
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    shutil.copytree(model, d / "model2")  # a second model folder: path options must change the path used
    files = {}
    for name in ("", "2"):
        write_math_jsonl(make_arithmetic_problems(32, seed=1, kind="add"), str(d / f"math{name}.jsonl"))
        (d / f"sft{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                    for i in range(32)))
        (d / f"prompts{name}.jsonl").write_text("".join(json.dumps({"query_id": f"q{i}", "prompt": f"{i}+1="}) + "\n"
                                                        for i in range(32)))
        (d / f"pairs{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1),
                                                                  "rejected": str(i + 2)}) + "\n" for i in range(32)))
        for kind in ("math", "sft", "prompts", "pairs"):
            files[kind + name] = str(d / f"{kind}{name}.jsonl")
    files["rm"], files["rm2"] = _reward_model(model, str(d / "rm")), _reward_model(model, str(d / "rm2"))
    return SimpleNamespace(model=model, model2=str(d / "model2"), root=str(d / "root"), root2=str(d / "root2"),
                           builds={}, **files)


def _reward_model(model: str, out: str) -> str:
    """A reward model folder (``model`` with a fresh scalar head) of the tiny model's tokenizer."""
    import torch

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    save_hf(build_from_hf(model, grid=single_process_grid(), dtype=torch.float32, is_critic=True), out,
            tokenizer_src=model)
    return out


def _entry(exp: str, key: str):
    table = TABLES.get(exp)
    assert table is not None and exp in BASE_ARGS, (
        f"experiment {exp!r} has no option table in {tables.__file__}: add TABLES[{exp!r}] (where each of its "
        f"options is read) and BASE_ARGS[{exp!r}]")
    entry = table.get(key, COMMON.get(key))
    assert entry is not None, (
        f"option {key!r} of experiment {exp!r} has no entry in {tables.__file__}: add a non-default value and where "
        "the value arrives (the interface, engine or spec field that uses it); an option nothing reads must be removed")
    return entry


def _overrides(env, exp, *items):
    out = BASE_ARGS[exp](env) + [f"fileroot={env.root}"]
    for it in items:
        out.append(NEEDS[it](env) if it in NEEDS else it)
    return out


def _build(env, exp, overrides):
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec

    key = (exp, tuple(overrides))
    if key not in env.builds:
        cfg = load_config(_experiments()[exp], [], overrides)
        env.builds[key] = (cfg, Built(build_spec(exp, cfg)))
    return env.builds[key]


def _value(entry, env) -> str:
    return entry.value(env) if callable(entry.value) else entry.value


@pytest.mark.parametrize("exp,key", CASES, ids=[f"{e}:{k}" for e, k in CASES])
def test_option_reaches_its_user(env, exp, key):
    from realhf.api.quickstart.entry import ConfigError, load_config

    entry = _entry(exp, key)
    item = f"{key}={_value(entry, env)}"
    if isinstance(entry, Refused):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(_experiments()[exp], [], _overrides(env, exp, item))
        return
    if isinstance(entry, Launcher):
        cfg, _ = _build(env, exp, _overrides(env, exp, item))
        assert str(functools.reduce(getattr, key.split("."), cfg)) == entry.value
        with open(os.path.join(ROOT, entry.reader)) as f:
            assert f"config.{key}" in f.read(), f"{entry.reader} no longer reads config.{key}: update the entry of {key!r}"
        return
    cfg, built = _build(env, exp, _overrides(env, exp, *entry.needs, *entry.with_, item))
    _, base = _build(env, exp, _overrides(env, exp, *entry.needs))
    parsed = functools.reduce(getattr, key.split("."), cfg)
    want = parsed if entry.expect is SAME else entry.expect(parsed) if callable(entry.expect) else entry.expect
    got = entry.where(built)
    assert got == want, f"{exp} {item}: {got!r} arrived where it is used, expected {want!r}"
    assert entry.where(base) != want, f"{exp}: the check of {key!r} sees {want!r} without {item}: it checks nothing"


def test_every_entry_is_an_option():
    """No entry outlives its option (a removed or renamed option must take its entry along)."""
    options = {exp: {k for e, k in CASES if e == exp} for exp in TABLES}
    for exp, table in TABLES.items():
        assert not set(table) - options.get(exp, set()), (exp, sorted(set(table) - options.get(exp, set())))
    assert not set(COMMON) - set().union(*options.values()), sorted(set(COMMON) - set().union(*options.values()))
