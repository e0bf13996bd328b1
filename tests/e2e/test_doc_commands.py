"""Every shell command shown in README.md and docs/*.md runs as written.

Each fenced shell block (```bash, ```sh, ```shell, ```console or a fence with no language) carries, on the line
before its fence, a marker a reader does not see and this test reads:

- ``<!-- ci: run -->``: run here, as written, in a folder holding the files the commands name (the placeholders of
  ``PLACEHOLDERS`` replaced);
- ``<!-- ci: run, slow -->``: run as written under ``-m slow``; the default suite checks it as a dry run;
- ``<!-- ci: dry-run -->`` (it needs a GPU, a cluster or a long run): a quickstart command goes through the
  quickstart's ``--dry-run`` (its config files exist, every option parses and validates, the experiment builds, the
  launcher prints what it would submit; nothing starts); the evaluation command through its argument, dataset and
  model checks; ``bash FILE`` through ``bash -n FILE``; any other ``python`` command through ``--help``;
- ``<!-- ci: skip, <reason> -->``: not checked, for the reason given.

Output, diagrams and data rows are fenced as ```text (or their own language) and carry no marker. A ```python block
whose first line is ``# some/file.py`` is written to that file in the folder, so commands that import it find it.
"""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "README.md").is_file() and (p / "realhf").is_dir())
DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "configuration.md")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*ci:\s*(.*?)\s*-->")
KINDS = re.compile(r"run|run, slow|dry-run|skip, \S.*")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")

# what the commands' placeholders stand for in the prepared folder; ``...`` ("the options of the run") becomes the
# options of the block's previous command of the same experiment, else the experiment's own options below
PLACEHOLDERS = {"MODEL": "{model}", "CKPT": "{model}", "OUT": "{work}/eval_out", "<options>": ""}
EXPERIMENT_OPTIONS = {
    "ppo-math": ["actor.path=MODEL", "dataset.path=math.jsonl"],
    "async-ppo-math": ["actor.path=MODEL", "dataset.path=math.jsonl", "allocation_mode=gen.d1m1p1+d1m1p1",
                       "n_devices_per_node=2"],
    "sft": ["model.path=MODEL", "dataset.train_path=train.jsonl", "dataset.valid_path=valid.jsonl"],
    "gen": ["model.path=MODEL", "dataset.path=prompts.jsonl"],
}
# what scripts/tiny_arith_learning.py leaves behind, which examples/configs/grpo-tiny-arith-cpu.yaml reads
TINY_ARITH_MODEL = "outputs/tiny_arith/runs/sft-tiny-arith/run/checkpoints/default/epoch1epochstep384globalstep384"
TINY_ARITH_DATA = "outputs/tiny_arith/data/rl_train.jsonl"
QUICKSTART = ["python", "-m", "realhf.apps.quickstart"]
EVALUATION = ["python", "evaluation/eval_and_aggregate.py"]


class Block(NamedTuple):
    doc: str  # path relative to the repository
    line: int  # the fence's line, 1-based
    lang: str
    marker: Optional[str]  # the text after "ci:", None when unmarked
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str:
        return (self.marker or "").split(",")[0].strip()


def read_blocks(path: Path) -> List[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        prev = MARKER.fullmatch(lines[start - 1].strip()) if start else None
        blocks.append(Block(str(path.relative_to(ROOT)), start + 1, m.group(3).lower(),
                            prev.group(1) if prev else None, "\n".join(lines[start + 1:i])))
        i += 1
    return blocks


def commands(block: Block) -> List[List[str]]:
    """The block's commands as argument lists (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", block.text)
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


def shell_blocks() -> List[Block]:
    return [b for doc in DOCS for b in read_blocks(doc) if b.lang in SHELL_LANGS]


BLOCKS = [b for b in shell_blocks() if b.marker is not None and KINDS.fullmatch(b.marker)]


def test_every_shell_block_is_marked():
    """A shell block without a valid marker, or a marker above a block that is not shell, fails here by name."""
    problems = []
    for doc in DOCS:
        for b in read_blocks(doc):
            if b.lang in SHELL_LANGS and b.marker is None:
                problems.append(f"{b.id}: shell block without a '<!-- ci: ... -->' marker on the line before it "
                                "(run | run, slow | dry-run | skip, <reason>; output and diagrams are ```text)")
            elif b.lang in SHELL_LANGS and not KINDS.fullmatch(b.marker):
                problems.append(f"{b.id}: marker 'ci: {b.marker}' is not one of run | run, slow | dry-run | "
                                "skip, <reason>")
            elif b.lang not in SHELL_LANGS and b.marker is not None:
                problems.append(f"{b.id}: a ```{b.lang} block is not a command; drop its 'ci:' marker")
            elif b.lang in SHELL_LANGS and b.kind != "skip" and not commands(b):
                problems.append(f"{b.id}: shell block with no command; fence output as ```text")
    assert not problems, "\n".join(problems)
    assert len(BLOCKS) >= 10 and any(b.kind == "run" for b in BLOCKS)


# ----------------------------------------------------------------------------- the prepared folder
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with the repository's top-level entries (linked; not outputs/), the data files the commands name,
    the files ```python blocks say they are, and stand-ins for what scripts/tiny_arith_learning.py writes. Returns
    (folder, tiny model folder)."""
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model
    from realhf.testing import write_sum_rows

    d = tmp_path_factory.mktemp("doc_commands")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "outputs"):
            (d / entry.name).symlink_to(entry)
    # head size 32 (vLLM's CPU attention), 2 key/value heads (tensor parallel 2), 32k positions: every layout and
    # sequence length of the configs the docs name
    model = ensure_tiny_model("qwen2", num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768)
    write_math_jsonl(make_arithmetic_problems(16, seed=3, kind="easy"), str(d / "math.jsonl"))
    write_sum_rows(str(d / "train.jsonl"))
    write_sum_rows(str(d / "valid.jsonl"), n=8)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    (d / TINY_ARITH_MODEL).parent.mkdir(parents=True)
    (d / TINY_ARITH_MODEL).symlink_to(model)
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="add"), str(d / TINY_ARITH_DATA))
    for doc in DOCS:
        for b in read_blocks(doc):
            first = b.text.split("\n", 1)[0].strip()
            if b.lang == "python" and re.fullmatch(r"#\s*[\w./-]+\.py", first):
                f = d / first.lstrip("#").strip()
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(b.text)
    return d, model


def substitute(argv: List[str], previous: List[List[str]], work_dir: Path, model: str) -> List[str]:
    """``argv`` with the placeholders replaced (see PLACEHOLDERS)."""
    out = []
    for i, a in enumerate(argv):
        if a == "...":
            exp = argv[3] if argv[:3] == QUICKSTART else None
            assert exp in EXPERIMENT_OPTIONS, f"'...' in {shlex.join(argv)!r}: no options for it in EXPERIMENT_OPTIONS"
            same = [p for p in previous if p[:4] == argv[:4] and "..." not in p]
            out += same[-1][4:] if same else substitute(EXPERIMENT_OPTIONS[exp], [], work_dir, model)
            continue
        key, sep, value = a.rpartition("=")
        if value in PLACEHOLDERS:
            a = key + sep + PLACEHOLDERS[value].format(model=model, work=work_dir)
            if not a:
                continue
        out.append(a)
    return out


def shell_text(block: Block, work_dir: Path, model: str) -> str:
    text = block.text
    for name, value in PLACEHOLDERS.items():
        text = re.sub(rf"(?<![\w.<]){re.escape(name)}(?![\w>])", value.format(model=model, work=work_dir), text)
    return text


# ----------------------------------------------------------------------------- dry-run checks
def dry_run_quickstart(argv: List[str], work_dir: Path, capsys) -> None:
    from realhf.apps import quickstart
    from realhf.base import logging

    args = argv[3:] + ([] if "--dry-run" in argv else ["--dry-run"])
    fileroot = work_dir / "fileroot"
    log = logging.getLogger("realhf")
    level = log.level  # the dry run quiets realhf's log; the tests after this one keep theirs
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work_dir)
        mp.syspath_prepend(str(work_dir))  # as `python -m` puts the working folder first
        mp.setenv("REALHF_FILEROOT", str(fileroot))
        try:
            rc = quickstart.main(args)
        finally:
            log.setLevel(level)
    out, err = capsys.readouterr()
    if rc != 0 and "vllm" in err.lower() and importlib.util.find_spec("vllm") is None:
        pytest.skip(f"{shlex.join(argv)} needs vLLM, which is not installed here")
    assert rc == 0, f"{shlex.join(argv)}\nexit code {rc}\n{err[-3000:]}"
    assert "# dry run of" in out, out[-3000:]
    assert not fileroot.exists(), "a dry run writes nothing"


def dry_run_evaluation(argv: List[str]) -> None:
    from realhf.evaluation import data_loader, engine, runner

    try:
        args = runner.parse_args(argv[2:])
    except SystemExit as e:
        raise AssertionError(f"{shlex.join(argv)}: the evaluation's arguments do not parse (exit {e.code})") from None
    runner._validate(args)
    for name in args.data_names.split(","):
        assert data_loader.load_problems(name.strip(), args.data_dir), name
    engine.check_model_path(args.model_path)


def dry_run(argv: List[str], work_dir: Path, capsys) -> None:
    if argv[:3] == QUICKSTART:
        dry_run_quickstart(argv, work_dir, capsys)
    elif argv[:2] == EVALUATION:
        dry_run_evaluation(argv)
    elif argv[0] == "bash" and len(argv) == 2:
        assert (work_dir / argv[1]).is_file(), f"{argv[1]} does not exist"
        r = subprocess.run(["bash", "-n", argv[1]], cwd=work_dir, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    elif argv[0] == "python":
        target = ["-m", argv[2]] if argv[1] == "-m" else [argv[1]]
        r = subprocess.run([sys.executable, *target, "--help"], cwd=work_dir, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    else:
        raise AssertionError(f"no dry-run check for {shlex.join(argv)!r}: mark its block run, or skip with a reason")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "dry-run" or b.marker == "run, slow"],
                         ids=lambda b: b.id)
def test_doc_command_dry_run(block, work, capsys):
    work_dir, model = work
    done: List[List[str]] = []
    for argv in commands(block):
        argv = substitute(argv, done, work_dir, model)
        dry_run(argv, work_dir, capsys)
        done.append(argv)


# ----------------------------------------------------------------------------- runs
@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.slow] if b.marker == "run, slow" else [])
                                   for b in BLOCKS if b.kind == "run"], ids=lambda b: b.id)
def test_doc_command_runs(block, work, tmp_path):
    """The block's commands, as written but for the placeholders, exit 0, and every quickstart run among them
    ends with its summary."""
    work_dir, model = work
    assert "..." not in re.findall(r"\S+", block.text), f"{block.id}: '...' cannot run as written; mark it dry-run"
    fileroot = tmp_path / "fileroot"
    env = dict(os.environ, REALHF_FILEROOT=str(fileroot),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", shell_text(block, work_dir, model)], cwd=work_dir, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "vllm" in r.stderr.lower() and importlib.util.find_spec("vllm") is None:
        pytest.skip(f"{block.id} needs vLLM, which is not installed here")
    assert r.returncode == 0, f"{block.id}: exit code {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    runs = [a for a in commands(block) if a[:3] == QUICKSTART]
    finished = re.findall(r"^\S+/\S+ finished: \d+ steps", r.stdout, re.M)  # the end-of-run summary of each run
    assert len(finished) == len(runs), r.stdout[-3000:]


# ----------------------------------------------------------------------------- the dependency table
def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[;\s]", spec.strip(), maxsplit=1)[0].lower()


def test_dependency_table_lists_every_requirement_and_where_it_is_used():
    """docs/dependencies.md has one row per package of requirements.txt and of each extra of setup.py, under the
    right extra, and every file or folder it names as the place of use exists."""
    import ast

    wanted = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            wanted[_requirement_name(line.split("#")[0])] = "core"
    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    for extra, specs in extras.items():
        for spec in specs:
            wanted.setdefault(_requirement_name(spec), extra)
    rows = {}
    for line in (ROOT / "docs" / "dependencies.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0] not in ("package", "---"):
            rows[cells[0].lower()] = cells
    assert {p: rows[p][1].strip("`") for p in rows} == wanted, "docs/dependencies.md and the requirements differ"
    for name, (_, _, _, where) in rows.items():
        for path in re.findall(r"`((?:realhf|tests|evaluation|scripts|csrc)/[\w./]*|pytest\.ini)`", where):
            assert (ROOT / path).exists(), f"docs/dependencies.md: {name} is used in {path}, which does not exist"
