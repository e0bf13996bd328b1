"""The quickstart registry and command line: ``<experiment> [--config FILE.yaml ...] [key=value ...]``.

This module holds the one registry of experiments: :func:`register_quickstart_exp` (name -> config dataclass and
the function that builds the experiment's spec from a config). Experiments register themselves where they are
defined (``realhf.experiments``); ``python -m realhf.apps.quickstart`` imports them, parses the command line
here and runs the result.

A command line is turned into a config in this order, later sources winning: the config dataclass
defaults (with ``experiment_name`` defaulting to the experiment's registered name), each YAML file
given with ``--config`` in order, then the ``key=value`` overrides in order. The result is built
back into the dataclasses so every ``__post_init__`` check runs. Unknown keys, values of the wrong
type and failed checks raise :class:`ConfigError` whose one-paragraph message names the key, the
value and what is allowed; :func:`main` prints it and returns 2 (no traceback).

A renamed option keeps its old name as a deprecated alias: a config class lists them in ``DEPRECATED_KEYS`` (old
dotted key -> new dotted key); in a YAML file or an override the old name sets the new option, and the loader says
so once, in one warning naming every old name it met (:func:`deprecated_keys`). A file that sets both names of one
option is refused.

Override values are read with Hydra's override grammar (``1e-4``, ``true``, ``null``, ``[1,2]``,
quoted strings), except for string-typed keys, which take the text after ``=`` verbatim (so
``allocation_mode=actor_gen:d2m1p1,*:d1m2p1`` needs no quoting); ``key=null`` still means None for
optional strings.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from realhf.base import logging

logger = logging.getLogger(__name__)

USAGE = ("usage: python -m realhf.apps.quickstart <experiment> [--config FILE.yaml ...] [key=value ...] "
         "[-q|--quiet | -v|--verbose] [--help]")


class ConfigError(Exception):
    """A bad command line or config; the message is meant for the user as is."""


class HelpRequested(Exception):
    """Raised by :func:`parse_cli` for ``--help``; ``text`` is what to print."""

    def __init__(self, text: str):
        super().__init__("help requested")
        self.text = text


class QuickstartExperiment(NamedTuple):
    name: str
    config_cls: type
    build_fn: Optional[Callable[[Any], Any]]  # config -> ExperimentSpec (realhf.api.core.system_api)


_EXPERIMENTS: Dict[str, QuickstartExperiment] = {}


def register_quickstart_exp(name: str, config_cls: type, build_fn: Optional[Callable[[Any], Any]] = None) -> None:
    """Make ``name`` an experiment: its config is a ``config_cls`` dataclass and ``build_fn(config)`` builds its
    ExperimentSpec. Registering the same triple again is a no-op."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", name):
        raise ValueError(f"quickstart experiment name must be letters, digits, '-' or '_', got {name!r}")
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise ValueError(f"quickstart experiment {name!r}: config_cls must be a dataclass, got {config_cls!r}")
    if build_fn is not None and not callable(build_fn):
        raise ValueError(f"quickstart experiment {name!r}: build_fn must be callable, got {build_fn!r}")
    old = _EXPERIMENTS.get(name)
    if old is not None and (old.config_cls is not config_cls or old.build_fn is not build_fn):
        raise ValueError(f"quickstart experiment {name!r} is already registered (with {old.config_cls.__name__})")
    _EXPERIMENTS[name] = QuickstartExperiment(name, config_cls, build_fn)


def registered_experiments() -> Dict[str, QuickstartExperiment]:
    """name -> (name, config_cls, build_fn), a copy."""
    return dict(_EXPERIMENTS)


# ----------------------------------------------------------------------------- schema walking
class Option(NamedTuple):
    key: str  # dotted
    type: str
    default: Any
    help: str
    is_section: bool


def _unwrap_optional(t):
    if typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return t, False


def _type_str(t) -> str:
    inner, opt = _unwrap_optional(t)
    origin = typing.get_origin(inner)
    if origin in (list, List):
        args = typing.get_args(inner)
        s = f"list[{_type_str(args[0]) if args else 'any'}]"
    elif isinstance(inner, type):
        s = inner.__name__
    else:
        s = str(inner).replace("typing.", "")
    return f"{s} | None" if opt else s


def _field_default(f: dataclasses.Field, obj: Any) -> Any:
    if obj is not None:
        return getattr(obj, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def config_options(cls: type, prefix: str = "", obj: Any = None) -> List[Option]:
    """Every option of a config dataclass, depth first; sections are listed before their keys."""
    hints = typing.get_type_hints(cls)
    out: List[Option] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        t = hints[f.name]
        inner, _ = _unwrap_optional(t)
        default = _field_default(f, obj)
        key = prefix + f.name
        helptext = f.metadata.get("help", "")
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            out.append(Option(key, inner.__name__, None, helptext or (inner.__doc__ or "").strip(), True))
            sub = default if dataclasses.is_dataclass(default) else None
            out.extend(config_options(inner, key + ".", sub))
        else:
            out.append(Option(key, _type_str(t), default, helptext, False))
    return out


def _fmt_default(v: Any) -> str:
    if v is dataclasses.MISSING:
        return "(required)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return repr(v)
    return str(v)


def format_options(cls: type, defaults: Optional[Dict[str, Any]] = None) -> str:
    lines = []
    defaults = defaults or {}
    for o in config_options(cls):
        if o.key in defaults:
            o = o._replace(default=defaults[o.key])
        if o.is_section:
            lines.append(f"  {o.key}.*  -- {o.help}")
        else:
            lines.append(f"  {o.key}: {o.type} = {_fmt_default(o.default)}")
            if o.help:
                lines.append(f"      {o.help}")
    return "\n".join(lines)


def help_text(name: Optional[str] = None) -> str:
    """``--help`` output: usage, the experiments, and every option of ``name`` (or the common ones)."""
    from realhf.api.quickstart.config import BaseExperimentConfig

    parts = [USAGE, "", "experiments:"]
    if _EXPERIMENTS:
        width = max(len(n) for n in _EXPERIMENTS)
        for n, e in sorted(_EXPERIMENTS.items()):
            doc = (e.config_cls.__doc__ or "").strip().splitlines()
            parts.append(f"  {n.ljust(width)}  {doc[0] if doc else e.config_cls.__name__}")
    else:
        parts.append("  (none registered)")
    parts.append("")
    if name is None:
        parts.append("options common to every experiment (run '<experiment> --help' for all of its options):")
        parts.append(format_options(BaseExperimentConfig))
    else:
        exp = _EXPERIMENTS[name]
        parts.append(f"options of {name!r} ({exp.config_cls.__name__}); set them in YAML or as key=value:")
        parts.append(format_options(exp.config_cls, _name_default(exp)))
        renames = deprecated_keys(exp.config_cls)
        if renames:
            parts.append("deprecated option names (still accepted, with a warning):")
            parts.extend(f"  {old} -> {new}" for old, new in renames.items())
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------- key checks
def _all_keys(cls: type) -> List[str]:
    return [o.key for o in config_options(cls)]


def _unknown_key(key: str, cls: type, source: str) -> ConfigError:
    keys = _all_keys(cls)
    cands = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    last = key.rsplit(".", 1)[-1]
    lasts = {k: k.rsplit(".", 1)[-1] for k in keys}
    for k, l in lasts.items():
        if l == last and k not in cands:
            cands.append(k)
    if not cands:
        close_last = set(difflib.get_close_matches(last, list(set(lasts.values())), n=3, cutoff=0.7))
        cands = [k for k, l in lasts.items() if l in close_last]
    hint = f" Did you mean {', '.join(cands[:5])}?" if cands else ""
    return ConfigError(
        f"unknown config key {key!r} (in {source}) for {cls.__name__}.{hint} Run with --help to list every option."
    )


def _section_type(cls: type, name: str):
    """(field exists, dataclass type of the field or None)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if name not in fields:
        return False, None
    inner, _ = _unwrap_optional(typing.get_type_hints(cls)[name])
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        return True, inner
    return True, None


def _check_mapping_keys(data: dict, cls: type, root: type, prefix: str, source: str) -> None:
    for k, v in data.items():
        key = f"{prefix}{k}"
        exists, sub = _section_type(cls, str(k))
        if not exists:
            raise _unknown_key(key, root, source)
        if sub is not None and isinstance(v, dict):
            _check_mapping_keys(v, sub, root, key + ".", source)


def _resolve_key(key: str, root: type, source: str):
    """Check a dotted key; return the type annotation of the field it names."""
    cls, t = root, None
    parts = key.split(".")
    for i, part in enumerate(parts):
        if cls is None:
            raise ConfigError(f"config key {key!r} (in {source}): {'.'.join(parts[:i])!r} is a value, not a section")
        exists, sub = _section_type(cls, part)
        if not exists:
            raise _unknown_key(key, root, source)
        t = typing.get_type_hints(cls)[part]
        cls = sub
    return t


# ----------------------------------------------------------------------------- deprecated names
def deprecated_keys(cls: type) -> Dict[str, str]:
    """Old dotted option names of the config class ``cls`` -> their names now (its ``DEPRECATED_KEYS``)."""
    return dict(getattr(cls, "DEPRECATED_KEYS", None) or {})


def _rename_in_mapping(data: dict, renames: Dict[str, str], source: str) -> List[str]:
    """Move the value of each old key found in the nested mapping ``data`` (a YAML file's) to its new key; returns
    the old keys found."""
    used = []
    for old, new in renames.items():
        *path, last = old.split(".")
        d = data
        for part in path:
            d = d.get(part) if isinstance(d, dict) else None
        if not isinstance(d, dict) or last not in d:
            continue
        value = d.pop(last)
        *path, last = new.split(".")
        d = data
        for part in path:
            if d.get(part) is None:
                d[part] = {}
            d = d[part]
            if not isinstance(d, dict):
                raise ConfigError(f"{source} sets {old!r} (now {new!r}), but {part!r} there is a value, not a section")
        if last in d:
            raise ConfigError(f"{source} sets both {new!r} and its deprecated old name {old!r}; keep {new!r} only")
        d[last] = value
        used.append(old)
    return used


def _warn_deprecated(used: List[str], renames: Dict[str, str]) -> None:
    if used:
        names = ", ".join(f"{old} -> {renames[old]}" for old in dict.fromkeys(used))
        logger.warning(f"deprecated option names (they still work, but use the new ones): {names}")


# ----------------------------------------------------------------------------- building
def _one_line(s: str) -> str:
    return " ".join(str(s).split())


def _omegaconf_error(e: Exception, source: str, cls: Optional[type] = None) -> ConfigError:
    key = getattr(e, "full_key", None)
    msg = (getattr(e, "msg", None) or str(e)).strip().split("\n")[0]
    where = f" for {key}" if key else ""
    expected = ""
    if key and cls is not None:
        types = {o.key: o.type for o in config_options(cls)}
        if key in types:
            expected = f"; expected {types[key]}"
    return ConfigError(_one_line(f"bad value{where} (in {source}): {msg}{expected}"))


def _explain(cls: type, prefix: str, kwargs: dict, e: Exception) -> str:
    msg = _one_line(str(e))
    if not prefix:
        return f"invalid config: {msg}"
    hits = []
    for name in kwargs:
        m = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", msg)
        if m:
            hits.append((m.start(), name))
    if hits:
        name = min(hits)[1]
        return f"invalid value {prefix}{name}={kwargs[name]!r}: {msg}"
    return f"invalid config section {prefix[:-1]}: {msg}"


def _build(cls: type, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in data:
            continue
        v = data[f.name]
        inner, _ = _unwrap_optional(hints[f.name])
        if isinstance(inner, type) and dataclasses.is_dataclass(inner) and isinstance(v, dict):
            v = _build(inner, v, f"{prefix}{f.name}.")
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(_explain(cls, prefix, kwargs, e)) from None


def leaves(cls: type, data: Dict[str, Any], prefix: str = ""):
    """Yield (dotted key, the section class, field name, value) for every non-section field of ``data`` (a mapping
    as :func:`config_data` returns) under config class ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        v, inner = data[f.name], _unwrap_optional(hints[f.name])[0]
        if isinstance(inner, type) and dataclasses.is_dataclass(inner) and isinstance(v, dict):
            yield from leaves(inner, v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f.name, v


def _is_str_type(t) -> bool:
    inner, _ = _unwrap_optional(t)
    return inner is str


def _override_value(item: str, key: str, raw: str, t, parser) -> Any:
    if _is_str_type(t):
        raw_s = raw.strip()
        if raw_s == "null" and _unwrap_optional(t)[1]:
            return None
        if len(raw_s) >= 2 and raw_s[0] == raw_s[-1] and raw_s[0] in "'\"":
            return raw_s[1:-1]
        return raw_s
    from hydra.errors import HydraException

    try:
        ov = parser.parse_override(item)
    except HydraException as e:
        raise ConfigError(_one_line(f"cannot read override {item!r}: {e}")) from None
    if ov.is_sweep_override():
        raise ConfigError(f"override {item!r} looks like a sweep (comma-separated values); sweeps are not "
                          f"supported: give one value (a list as [a,b]; quote a string that contains commas)")
    return ov.value()


def load_config(cls: type, config_files: Sequence[str] = (), overrides: Sequence[str] = (),
                defaults: Optional[Dict[str, Any]] = None):
    """Build a ``cls`` instance from defaults, YAML files and ``key=value`` overrides (see the module
    docstring). Raises :class:`ConfigError` with a user-facing message."""
    data, used, renames = _merged(cls, config_files, overrides, defaults)
    _warn_deprecated(used, renames)
    return _build(cls, data)


def config_data(cls: type, config_files: Sequence[str] = (), overrides: Sequence[str] = (),
                defaults: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The nested mapping :func:`load_config` builds ``cls`` from (defaults, files and overrides merged, old names
    renamed, keys and types checked), before any section's own checks run."""
    return _merged(cls, config_files, overrides, defaults)[0]


def _merged(cls: type, config_files: Sequence[str], overrides: Sequence[str],
            defaults: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], List[str], Dict[str, str]]:
    """(merged mapping, the deprecated keys used, the renames) for :func:`load_config`."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.structured(cls)
        if defaults:
            cfg = OmegaConf.merge(cfg, defaults)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(_one_line(f"the defaults of {cls.__name__} are not valid: {e}")) from None

    renames = deprecated_keys(cls)
    used: List[str] = []
    for path in config_files:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(_one_line(f"config file {path!r} is not valid YAML: {e}")) from None
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of keys to values, got {type(data).__name__}")
        used += _rename_in_mapping(data, renames, f"config file {path!r}")
        _check_mapping_keys(data, cls, cls, "", path)
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, path, cls) from None

    parser = OverridesParser.create()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"cannot read override {item!r}: expected key=value, e.g. model.optimizer.lr=1e-4")
        if key[0] in "+~":
            raise ConfigError(f"override {item!r}: only plain key=value overrides are supported (no '+'/'~' prefixes)")
        if key in renames:
            used.append(key)
            key = renames[key]
            item = f"{key}={raw}"
        t = _resolve_key(key, cls, "the command line")
        value = _override_value(item, key, raw, t, parser)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, "the command line", cls) from None

    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, "the config", cls) from None
    return data, used, renames


def config_to_yaml(config: Any) -> str:
    """YAML text of a config instance (loadable with ``--config``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ----------------------------------------------------------------------------- CLI
def _experiment(name: str) -> QuickstartExperiment:
    if name not in _EXPERIMENTS:
        close = difflib.get_close_matches(name, list(_EXPERIMENTS), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"unknown experiment {name!r}; registered: {sorted(_EXPERIMENTS)}.{hint}")
    return _EXPERIMENTS[name]


def parse_cli(argv: Sequence[str]) -> Tuple[str, Any]:
    """``[experiment, --config FILE ..., key=value ...]`` -> (experiment name, config instance).

    Raises :class:`HelpRequested` for ``-h``/``--help`` and :class:`ConfigError` for anything wrong.
    """
    exp, files, overrides = split_cli(argv)
    cfg = load_config(exp.config_cls, files, overrides, defaults=_name_default(exp))
    return exp.name, cfg


def cli_data(argv: Sequence[str]) -> Tuple[QuickstartExperiment, Dict[str, Any]]:
    """(the experiment, the nested mapping its config is built from: :func:`config_data`) for a command line as
    :func:`parse_cli` reads it."""
    exp, files, overrides = split_cli(argv)
    return exp, config_data(exp.config_cls, files, overrides, defaults=_name_default(exp))


def split_cli(argv: Sequence[str]) -> Tuple[QuickstartExperiment, List[str], List[str]]:
    """``[experiment, --config FILE ..., key=value ...]`` -> (the experiment, the YAML files, the overrides);
    :class:`HelpRequested` for ``-h``/``--help``, :class:`ConfigError` for an unreadable command line."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        if argv:
            raise HelpRequested(help_text())
        raise ConfigError(f"no experiment given; choose one of {sorted(_EXPERIMENTS)}. {USAGE}")
    name = argv[0]
    if name.startswith("-"):
        raise ConfigError(f"the first argument must be the experiment name, got {name!r}. {USAGE}")
    exp = _experiment(name)
    files: List[str] = []
    overrides: List[str] = []
    want_help = False
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            want_help = True
        elif a in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{a} needs a YAML file after it")
            files.append(argv[i + 1])
            i += 1
        elif a.startswith("--config="):
            files.append(a[len("--config="):])
        elif a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}; options are --config FILE and --help, the rest is key=value")
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(f"cannot read argument {a!r}: expected key=value (e.g. seed=2) or --config FILE")
        i += 1
    if want_help:
        raise HelpRequested(help_text(name))
    return exp, files, overrides


def _name_default(exp: QuickstartExperiment) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(exp.config_cls)}
    return {"experiment_name": exp.name} if "experiment_name" in names else {}


def main(argv: Optional[Sequence[str]], run: Callable[[str, Any], int]) -> int:
    """Parse the command line and ``run(experiment name, config)``; returns the exit code (2 for config errors)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        name, cfg = parse_cli(argv)
    except HelpRequested as h:
        sys.stdout.write(h.text)
        return 0
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    logger.info("Running quickstart experiment %r (%s/%s)", name, getattr(cfg, "experiment_name", "?"),
                getattr(cfg, "trial_name", "?"))
    return int(run(name, cfg) or 0)
