"""``docs/configuration.md``: every option of every experiment, with its type, default and help, generated from the
config classes (the same source as ``python -m realhf.apps.quickstart <experiment> --help``).

    python -m realhf.apps.config_docs            # rewrite docs/configuration.md
    python -m realhf.apps.config_docs --check    # exit 1 when the file is not what the config classes give

``tests/unit/test_config_docs.py`` runs the check, so the page cannot fall behind the code.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PATH = os.path.join(ROOT, "docs", "configuration.md")
ENV_DEFAULTS = ("REALHF_FILEROOT",)  # environment variables that change an option's default

HEADER = """# Configuration

Every option of every experiment, as `python -m realhf.apps.quickstart <experiment> --help` prints it. Set options in
a YAML file (`--config FILE`, nested sections) or on the command line as `key=value` (dotted keys: `ppo.gen.n=4`).
A bad value fails before any worker starts, with the key, the value and what is allowed.

This page is generated from the config classes by `python -m realhf.apps.config_docs`; a test fails when it is out of
date.
"""


def _cell(text: str) -> str:
    """``text`` as one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(value) -> str:
    from realhf.api.quickstart.entry import _fmt_default

    return _cell(_fmt_default(value))


def experiment_page(name: str) -> List[str]:
    """The markdown lines of one experiment: its description, then a table of its options, section by section."""
    from realhf.api.quickstart.entry import _EXPERIMENTS, _name_default, config_options, deprecated_keys

    exp = _EXPERIMENTS[name]
    doc = " ".join((exp.config_cls.__doc__ or "").strip().split("\n\n")[0].split())
    lines = [f"## `{name}`", "", doc, "", "| option | type | default | what it does |", "| --- | --- | --- | --- |"]
    defaults = _name_default(exp)
    for o in config_options(exp.config_cls):
        if o.is_section:
            lines.append(f"| **`{o.key}.*`** | section | | {_cell(o.help)} |")
        else:
            default = defaults.get(o.key, o.default)
            lines.append(f"| `{o.key}` | {_cell(o.type)} | `{_default(default)}` | {_cell(o.help)} |")
    renames = deprecated_keys(exp.config_cls)
    if renames:
        lines += ["", "Deprecated names, still accepted with a warning: "
                  + ", ".join(f"`{old}` → `{new}`" for old, new in renames.items()) + "."]
    return lines + [""]


def render() -> str:
    """The whole page."""
    from realhf.api.quickstart.entry import _EXPERIMENTS
    from realhf.experiments import registered

    registered()  # imports every experiment, so each registers its config class
    lines = [HEADER]
    names = sorted(_EXPERIMENTS)
    lines += ["Experiments: " + ", ".join(f"[`{n}`](#{n})" for n in names) + ".", ""]
    # the built-in defaults, not this machine's: a default that an environment variable changes is shown without it
    saved = {k: os.environ.pop(k) for k in ENV_DEFAULTS if k in os.environ}
    try:
        for n in names:
            lines += experiment_page(n)
    finally:
        os.environ.update(saved)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when they differ")
    ap.add_argument("--path", default=DEFAULT_PATH, help="the page (default docs/configuration.md)")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        current = open(a.path, encoding="utf-8").read() if os.path.isfile(a.path) else None
        if current != text:
            sys.stderr.write(f"{a.path} is not what the config classes give: run python -m realhf.apps.config_docs\n")
            return 1
        return 0
    with open(a.path, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
