"""The packages of realhf form layers that only look down (``realhf.LAYERS``), and no packages or modules import
each other in a circle. A package that defines ``LAYERS`` of its own (``realhf.system.LAYERS``) orders its
subpackages the same way. Read from the source with ``ast``: every import counts, at module level or inside a
function (a deferred import is a dependency all the same). The same source keeps to its size limits: no file
over ``MAX_FILE_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` lines."""
import ast
import functools
import importlib
import os
from typing import Dict, List, Optional, Set, Tuple

from realhf import LAYERS
from realhf.base.process import source_root

ROOT = source_root()
# folders of the source tree that are not part of the installed package
SOURCE_TREE_ONLY = ("evaluation", "tests", "scripts", "benchmarks", "examples")
# imports against the order that are known and due to move: (importing file, imported module) -> where it goes.
# Each entry must still be in the code (the test says when one is gone, so that the list only shrinks).
PENDING: dict = {}
# folders held to the size limits (benchmarks/ is not: a benchmark is a script that reads top to bottom)
SIZE_CHECKED = ("realhf", "scripts", "evaluation", "tests")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # from the ``def`` line to the function's last line, docstring and nested functions included
# files ("path") and functions ("path:Class.function") allowed over the limits -> why. Each must still be over its
# limit (the test says when one is not, so that the list only shrinks).
OVERSIZE_ALLOWED: Dict[str, str] = {}

Edge = Tuple[str, str, int, str]  # (importing module, its file, line, imported module)


@functools.lru_cache(maxsize=None)
def _modules() -> Dict[str, str]:
    """module name -> file, for every .py file under realhf/."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "realhf")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, modules: Dict[str, str], tree: ast.Module) -> List[Edge]:
    """Every import of realhf (or of the source tree) in one module (``tree``, parsed from ``path``): the most
    specific module each one names."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            sub = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            targets = sub if len(sub) == len(node.names) else [mod] + sub
        else:
            continue
        for t in targets:
            top = t.split(".")[0]
            if top == "realhf":
                while t not in modules:
                    t = t.rpartition(".")[0]
                if t != name:
                    edges.append((name, path, node.lineno, t))
            elif top in SOURCE_TREE_ONLY:
                edges.append((name, path, node.lineno, t))
    return edges


def _long_functions(body: List[ast.stmt], prefix: str = "") -> List[Tuple[str, int, int]]:
    """``(qualified name, line, length in lines)`` of each function over ``MAX_FUNCTION_LINES`` defined in ``body``,
    at any depth (methods, nested functions, functions under ``if``/``try``). Only statements are visited: a
    function is always defined by one."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            length = node.end_lineno - node.lineno + 1
            if not isinstance(node, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                out.append((name, node.lineno, length))
            out += _long_functions(node.body, name + ".")
            continue
        for field in ("body", "orelse", "finalbody"):
            out += _long_functions(getattr(node, field, None) or [], prefix)
        for part in getattr(node, "handlers", None) or getattr(node, "cases", None) or []:
            out += _long_functions(part.body, prefix)
    return out


def _oversize_of(rel: str, text: str, tree: Optional[ast.Module]) -> Dict[str, str]:
    """What of one file is over its limit: ``{"path" or "path:function": why}``; ``tree`` is None for a file too
    short to hold a function over the limit."""
    found = {}
    n_lines = len(text.splitlines())
    if n_lines > MAX_FILE_LINES:
        found[rel] = f"{rel}: {n_lines} lines (at most {MAX_FILE_LINES}): split it by idea"
    for name, line, length in _long_functions(tree.body) if tree is not None else []:
        found[f"{rel}:{name}"] = (f"{rel}:{line}: {name} is {length} lines (at most {MAX_FUNCTION_LINES}): "
                                  "split it into named steps")
    return found


@functools.lru_cache(maxsize=None)
def _read_source() -> Tuple[List[Edge], Dict[str, str]]:
    """Every .py file under ``SIZE_CHECKED`` parsed once, for both checks: (the imports of realhf's modules, in
    module order; what is over the size limits)."""
    modules = _modules()
    name_of = {path: name for name, path in modules.items()}
    edges: Dict[str, List[Edge]] = {}
    oversize: Dict[str, str] = {}
    for top in SIZE_CHECKED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for path in sorted(os.path.join(dirpath, f) for f in filenames if f.endswith(".py")):
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                name = name_of.get(path)
                short = text.count("\n") < MAX_FUNCTION_LINES  # no function of it can be over the limit
                tree = None if short and name is None else ast.parse(text, filename=path)
                if name is not None:
                    edges[name] = _imports(name, path, modules, tree)
                oversize.update(_oversize_of(os.path.relpath(path, ROOT), text, tree))
    return [e for name in sorted(edges) for e in edges[name]], oversize


def _graph() -> List[Edge]:
    return _read_source()[0]


def _where(e: Edge) -> str:
    return f"{os.path.relpath(e[1], ROOT)}:{e[2]} imports {e[3]}"


def _order_problem(e: Edge, layers, owner: str, src: List[str], dst: List[str], depth: int) -> List[str]:
    """What is wrong with import ``e`` under ``layers`` (those of package ``owner``: ``realhf`` or one of its packages
    with ``LAYERS`` of its own), both ends inside ``owner``; ``depth``: where ``owner``'s parts sit in a module name.
    Within one part, the part's own ``LAYERS`` (if any) decide."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    prefix = "" if owner == "realhf" else owner.split(".", 1)[1].replace(".", "/") + "/"
    a, b = src[depth] if len(src) > depth else None, dst[depth] if len(dst) > depth else None
    if a is None:
        return []  # the package's __init__ imports its own parts
    if a not in rank:
        return [f"{_where(e)}: realhf/{prefix}{a} is in no layer; add it to {owner}.LAYERS"]
    if b is None:
        return []  # the package itself (realhf, or e.g. realhf.system): its __init__ imports nothing
    if a == b:
        inner = getattr(importlib.import_module(".".join(src[:depth + 1])), "LAYERS", None)
        return _order_problem(e, inner, ".".join(src[:depth + 1]), src, dst, depth + 1) if inner else []
    if b not in rank or rank[b] >= rank[a]:
        below = [p for layer in layers[:rank[a]] for p in layer]
        allowed = "only " + ", ".join(below) if below else f"nothing else of {owner}"
        where = "above" if b in rank and rank[b] > rank[a] else "beside" if b in rank else "in no layer"
        return [f"{_where(e)}: {prefix}{a} may import {allowed}; {prefix}{b} is {where} it ({owner}.LAYERS)"]
    return []


def _against_the_order() -> List[str]:
    """Every import of a package above or beside the importer's (``realhf.LAYERS``, and inside a package with
    ``LAYERS`` of its own, those)."""
    pending = set()
    problems = []
    for e in _graph():
        src, dst = e[0].split("."), e[3].split(".")
        if src[0] != "realhf" or len(src) == 1:
            continue
        if dst[0] != "realhf":
            problems.append(f"{_where(e)}: {dst[0]}/ is part of the source tree, not of the realhf package")
            continue
        if (os.path.relpath(e[1], ROOT), e[3]) in PENDING:
            pending.add((os.path.relpath(e[1], ROOT), e[3]))
            continue
        problems += _order_problem(e, LAYERS, "realhf", src, dst, 1)
    problems += [f"{f} no longer imports {m}: remove it from PENDING" for f, m in sorted(set(PENDING) - pending)]
    return problems


def _cycle(nodes: Set[str], edges: Dict[str, Dict[str, Edge]]) -> List[str]:
    """One cycle of the graph as a list of nodes (first == last), or []."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(n: str) -> List[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, {})):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def _cycles_of(graph: List[Edge], node) -> List[str]:
    edges: Dict[str, Dict[str, Edge]] = {}
    for e in graph:
        a, b = node(e[0]), node(e[3])
        if a is not None and b is not None and a != b:
            edges.setdefault(a, {}).setdefault(b, e)
    found = _cycle(set(edges), edges)
    return [f"  {a} -> {b} ({_where(edges[a][b])})" for a, b in zip(found, found[1:])]


def _circles() -> List[str]:
    """A circle between the packages of realhf and one between its modules, if any. A package's ``__init__``
    importing its own modules is not counted: that is how a package re-exports or registers its parts."""
    graph = [e for e in _graph() if (os.path.relpath(e[1], ROOT), e[3]) not in PENDING]
    packages = {m for m, path in _modules().items() if path.endswith("__init__.py")}
    between_packages = _cycles_of(graph, lambda m: ".".join(m.split(".")[:2]) if m.startswith("realhf.") else None)
    own = [e for e in graph if not (e[0] in packages and e[3].startswith(e[0] + "."))]
    between_modules = _cycles_of(own, lambda m: m)
    return ((["a circle between packages:"] + between_packages if between_packages else [])
            + (["a circle between modules:"] + between_modules if between_modules else []))


def test_imports_look_down_without_circles():
    problems = _against_the_order()
    assert not problems, "imports against the layer order (realhf.LAYERS):\n" + "\n".join(problems)
    circles = _circles()
    assert not circles, "import cycles:\n" + "\n".join(circles)


def test_files_and_functions_keep_to_their_size():
    found = _read_source()[1]
    problems = [why for key, why in sorted(found.items()) if key not in OVERSIZE_ALLOWED]
    problems += [f"{key} is within its limit now: remove it from OVERSIZE_ALLOWED"
                 for key in sorted(set(OVERSIZE_ALLOWED) - set(found))]
    assert not problems, "over the size limits (one module one idea; functions that read as a procedure):\n" + \
        "\n".join(problems)
