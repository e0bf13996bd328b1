"""The evaluation pipeline behind ``eval_and_aggregate.py`` and :func:`evaluate_checkpoint`.

For each dataset, two passes: ``greedy`` (temperature 0, one answer) and ``sample``
(``n_sampling`` answers at ``temperature``/``top_p``). Each (dataset, pass) is written to
``<output_path>/<dataset>/<pass>.jsonl`` (one row per problem) with a sidecar ``<pass>.meta.json``
holding the generation arguments, the grading arguments and the sha256 of the jsonl. A re-run reuses
a pass whose generation arguments match (re-grading only if the grading arguments changed);
``--overwrite`` regenerates. Every file is written to a temporary file and renamed, and the sidecar
is removed before its jsonl is replaced and written after it, so an interrupted run never leaves a
result that a re-run would trust.

Per-problem seeds: ``int(sha256(f"{seed}:{dataset}:{row index}")[:4 bytes]) & 0x7fffffff``; sample j
of a problem draws from the stream of ``(problem seed, j)``, so results do not depend on batching,
the number of workers or the ``--max_problems`` subset.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Dict, List, Optional

from realhf.api.core.generation import SamplingParams
from realhf.base import logging
from realhf.base.topology import ParallelDims

from realhf.evaluation import data_loader, engine as engines, metrics as M, prompts

logger = logging.getLogger(__name__)

PASSES = ("greedy", "sample")


class EvalError(RuntimeError):
    """A user error found before generation (bad dataset, model path, engine): exit code 2."""


# ---------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval_and_aggregate.py",
        description="Evaluate a checkpoint on math benchmarks (greedy accuracy, pass@k, maj@k) and print a table.",
    )
    p.add_argument("--model_path", help="Hugging Face checkpoint folder (config.json + safetensors + tokenizer)")
    p.add_argument("--output_path", default="outputs/eval", help="folder for per-problem jsonl files and aggregate.json")
    p.add_argument("--data_names", default="math_500,aime24,amc23", help="comma-separated datasets")
    p.add_argument("--data_dir", default=None, help=f"datasets folder (default {data_loader.DEFAULT_DATA_DIR})")
    p.add_argument("--prompt_type", default="qwen-boxed", choices=prompts.PROMPT_TYPES)
    p.add_argument("--max_gen_tokens", type=int, default=32768, help="max new tokens per answer")
    p.add_argument("--n_sampling", type=int, default=32, help="samples per problem in the sampled pass (0: skip it)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--top_k", type=int, default=0, help="0: no top-k")
    p.add_argument("--seed", type=int, default=1, help="base seed (problem subsets and per-problem sampling seeds)")
    p.add_argument("--max_problems", type=int, default=None, help="a fixed seeded subset of N problems per dataset")
    p.add_argument("--engine", default="realhf", help="realhf (own engine in --n_workers processes), or a "
                                                      "generation-server backend: gen | vllm | sglang")
    p.add_argument("--allocation", default=None, help="generation servers as an allocation, e.g. vllm.d2m1p1 (2 vLLM "
                                                      "servers, tensor parallel 1): sets --engine, --n_servers and "
                                                      "--tensor_parallel_size")
    p.add_argument("--n_servers", type=int, default=1, help="generation servers (server backends)")
    p.add_argument("--n_workers", type=int, default=1, help="data-parallel generation processes (0: in this process)")
    p.add_argument("--threads_per_worker", type=int, default=None, help="torch threads per worker process")
    p.add_argument("--batch_size", type=int, default=16, help="prompts per generation batch")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA; vLLM: model's), float32, bfloat16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--enforce_eager", action="store_true", help="vLLM: no CUDA graphs")
    p.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--allow_last_number", action="store_true",
                   help="grade the last number of an answer when it has no boxed/'answer is' final answer")
    p.add_argument("--grade_timeout", type=float, default=10.0, help="seconds per graded answer")
    p.add_argument("--grader_workers", type=int, default=2, help="grading worker processes")
    p.add_argument("--overwrite", action="store_true", help="regenerate even when matching outputs exist")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def problem_seed(seed: int, dataset: str, idx: int) -> int:
    h = hashlib.sha256(f"{seed}:{dataset}:{idx}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------


def write_atomic(path: str, data: bytes):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; results are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _jsonl_bytes(rows: List[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _paths(out: str, dataset: str, pass_name: str):
    d = os.path.join(out, dataset)
    return os.path.join(d, f"{pass_name}.jsonl"), os.path.join(d, f"{pass_name}.meta.json")


def _remove_stale_tmp(*paths: str):
    """Delete temporary files left by an interrupted write of these files (never trusted)."""
    for path in paths:
        d, base = os.path.split(path)
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            if f.startswith(base + ".") and f.endswith(".tmp"):
                logger.info("removing %s left by an interrupted run", os.path.join(d, f))
                try:
                    os.unlink(os.path.join(d, f))
                except OSError:
                    pass


def _load_reusable(jsonl: str, meta_path: str, gen_key: dict) -> Optional[tuple]:
    """``(rows, meta)`` of a finished pass with the same generation arguments, else None."""
    if not (os.path.isfile(jsonl) and os.path.isfile(meta_path)):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        with open(jsonl, "rb") as f:
            data = f.read()
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", meta_path, e)
        return None
    if meta.get("generation") != json.loads(json.dumps(gen_key)):
        logger.info("%s: generation arguments changed, regenerating", jsonl)
        return None
    if meta.get("sha256") != hashlib.sha256(data).hexdigest():
        logger.warning("%s does not match its sidecar checksum (interrupted or edited), regenerating", jsonl)
        return None
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    if len(rows) != meta.get("num_rows"):
        return None
    return rows, meta


def _save(jsonl: str, meta_path: str, rows: List[dict], gen_key: dict, grade_key: dict):
    if os.path.exists(meta_path):
        os.unlink(meta_path)  # the old sidecar must never vouch for a new jsonl
    data = _jsonl_bytes(rows)
    write_atomic(jsonl, data)
    meta = {"generation": gen_key, "grading": grade_key, "sha256": hashlib.sha256(data).hexdigest(),
            "num_rows": len(rows), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())


# ---------------------------------------------------------------------------------------------------
# grading
# ---------------------------------------------------------------------------------------------------


class Grader:
    def __init__(self, timeout: float, workers: int, allow_last_number: bool):
        self.timeout = timeout
        self.workers = max(1, workers)
        self.allow_last_number = allow_last_number
        self._v = None

    @property
    def key(self) -> dict:
        return {"allow_last_number": self.allow_last_number, "grader": "realhf.reward.MathVerifier"}

    def verifier(self):
        if self._v is None:
            from realhf.reward import MathVerifier

            self._v = MathVerifier(timeout=self.timeout, max_workers=self.workers)
        return self._v

    def grade(self, texts: List[str], solutions: List[List[str]]) -> tuple:
        """``(extracted answers, correct flags, statuses)``."""
        from realhf.reward import extract_answer

        answers, graded = [], []
        for t in texts:
            a = extract_answer(t, allow_last_number=self.allow_last_number) if t else None
            answers.append(a)
            if self.allow_last_number and a is not None and extract_answer(t) is None:
                graded.append(f"\\boxed{{{a}}}")  # the last number becomes the final answer
            else:
                graded.append(t)
        res = self.verifier().verify_batch(graded, solutions, max_workers=self.workers) if texts else []
        return answers, [bool(ok) for ok, _ in res], [st for _, st in res]

    def grade_rows(self, rows: List[dict], problems: List[data_loader.Problem], pass_name: str):
        """Fill answers/scores (and maj@n for the sampled pass) of rows in place."""
        texts, sols, where = [], [], []
        for ri, (r, p) in enumerate(zip(rows, problems)):
            if r.get("max_new_tokens") == 0:
                continue  # the prompt alone fills the model's context: not generated, scores 0
            for j, t in enumerate(r["completions"]):
                texts.append(t)
                sols.append(p.solutions)
                where.append((ri, j))
        answers, scores, statuses = self.grade(texts, sols)
        for r in rows:
            n = len(r["completions"])
            st = "prompt_too_long" if r.get("max_new_tokens") == 0 else "ok"
            r["answers"], r["scores"], r["status"] = [None] * n, [False] * n, [st] * n
        for (ri, j), a, s, st in zip(where, answers, scores, statuses):
            rows[ri]["answers"][j], rows[ri]["scores"][j], rows[ri]["status"][j] = a, s, st
        if pass_name != "sample":
            return
        votes, vote_sols, vote_rows = [], [], []
        for ri, (r, p) in enumerate(zip(rows, problems)):
            _, ans = M.majority_vote(r["answers"])
            r["maj_answer"], r["maj_score"] = ans, False
            if ans is not None:
                votes.append(f"\\boxed{{{ans}}}")
                vote_sols.append(p.solutions)
                vote_rows.append(ri)
        if votes:
            res = self.verifier().verify_batch(votes, vote_sols, max_workers=self.workers)
            for ri, (ok, _) in zip(vote_rows, res):
                rows[ri]["maj_score"] = bool(ok)

    def close(self):
        if self._v is not None:
            self._v.close()
            self._v = None


# ---------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalRun:
    metrics: Dict[str, Dict[str, float]]
    table: str
    generated: List[str]  # "dataset/pass" generated in this run
    reused: List[str]  # ... reused from earlier runs
    regraded: List[str]
    output_path: str


def _sampling_configs(args, stop_ids: List[int], max_new: int) -> Dict[str, SamplingParams]:
    """The sampling of each pass (the generation contract's; every problem samples with its own seed)."""
    out = {"greedy": SamplingParams(n=1, greedy=True, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                                    stop_token_ids=list(stop_ids))}
    if args.n_sampling > 0:
        out["sample"] = SamplingParams(n=args.n_sampling, greedy=False, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, max_new_tokens=max_new, stop_token_ids=list(stop_ids))
    return out


def token_budgets(prompt_lengths: List[int], max_gen_tokens: int, max_pos: Optional[int]) -> List[int]:
    """Max new tokens per prompt: ``max_gen_tokens``, or, where prompt + answer would exceed the model's
    ``max_pos`` positions, the room left, rounded down to a multiple of 1/8 of its power of two (at most
    12.5% less) so that clamped prompts of similar length share batches. 0: the prompt alone fills the
    context (it is not generated and scores 0). A function of the prompt alone, so results do not
    depend on batching or on the other prompts."""
    out = []
    for n in prompt_lengths:
        room = max_gen_tokens if not max_pos else min(max_gen_tokens, max_pos - n)
        if room < max_gen_tokens and room > 0:
            q = max(1, (1 << (room.bit_length() - 1)) // 8)
            room = room // q * q
        out.append(max(0, room))
    return out


def _validate(args):
    if args.n_sampling < 0:
        raise EvalError(f"--n_sampling must be >= 0, got {args.n_sampling}")
    if args.n_sampling > 0 and args.temperature <= 0:
        raise EvalError("--temperature must be > 0 for the sampled pass (the greedy pass is always run)")
    if not 0 < args.top_p <= 1:
        raise EvalError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.max_gen_tokens < 1:
        raise EvalError(f"--max_gen_tokens must be >= 1, got {args.max_gen_tokens}")
    if args.max_problems is not None and args.max_problems < 1:
        raise EvalError(f"--max_problems must be >= 1, got {args.max_problems}")
    if args.n_workers < 0 or args.batch_size < 1:
        raise EvalError("--n_workers must be >= 0 and --batch_size >= 1")
    if args.prompt_type not in prompts.PROMPT_TYPES:
        raise EvalError(f"unknown prompt_type {args.prompt_type!r}; choose from {', '.join(prompts.PROMPT_TYPES)}")
    if args.allocation:  # e.g. vllm.d2m1p1: backend, servers (d) and tensor parallelism (m)
        backend, _, text = args.allocation.strip().partition(".")
        try:
            layout = ParallelDims.parse(text)
            if not backend or layout.pp != 1:
                raise ValueError("a backend before '.' and p1 (generation servers are not pipelined) are needed")
        except ValueError as e:
            raise EvalError(f"--allocation must look like vllm.d2m1p1 (<backend>.d<servers>m<tensor parallel>p1), "
                            f"got {args.allocation!r}: {e}") from None
        args.engine, args.n_servers, args.tensor_parallel_size = backend, layout.dp, layout.tp
        if args.engine == "realhf":
            raise EvalError("--allocation names a generation-server backend (gen, vllm, sglang), not realhf")
    if args.n_servers < 1 or args.tensor_parallel_size < 1:
        raise EvalError("--n_servers and --tensor_parallel_size must be >= 1")
    if args.engine not in engines.ENGINES:
        raise EvalError(f"unknown engine {args.engine!r}; available: {', '.join(sorted(engines.ENGINES))}")


@dataclasses.dataclass
class _Setup:
    """What every pass of a run shares, resolved before any generation."""

    datasets: Dict[str, List[data_loader.Problem]]
    built: Dict[str, List[tuple]]  # per dataset, each problem's prompt as (text, token ids)
    model_path: str
    fingerprint: dict
    max_pos: Optional[int]
    cfgs: Dict[str, SamplingParams]  # the sampling of each pass
    out: str


@dataclasses.dataclass
class _Outcome:
    """What the passes of a run produced: rows per dataset and pass, and which passes were generated or reused."""

    rows: Dict[str, Dict[str, List[dict]]] = dataclasses.field(default_factory=dict)
    effective_max_new: Dict[str, dict] = dataclasses.field(default_factory=dict)
    generated: List[str] = dataclasses.field(default_factory=list)
    reused: List[str] = dataclasses.field(default_factory=list)
    regraded: List[str] = dataclasses.field(default_factory=list)


class _RunEngine:
    """The engine of a run: the caller's, or the one named by ``args.engine``, made at the first generation (a run
    that reuses every pass makes none) and closed at the end, or aborted when the run fails."""

    def __init__(self, engine, args, model_path: str):
        self._engine, self._own, self._args, self._model_path = engine, engine is None, args, model_path
        self.name = getattr(engine, "name", None) or (args.engine if engine is None else type(engine).__name__)

    def get(self):
        if self._engine is None:
            try:
                self._engine = engines.make_engine(self._args.engine, self._model_path, self._args)
            except engines.EngineError as e:
                raise EvalError(str(e)) from None
        return self._engine

    def abort(self):
        if self._own and self._engine is not None and hasattr(self._engine, "abort"):
            self._engine.abort()
            self._engine = None

    def close(self):
        if self._own and self._engine is not None:
            self._engine.close()


def _resolve(args: argparse.Namespace) -> _Setup:
    """Check the arguments, the datasets and the model (an :class:`EvalError` before any generation), then build
    every prompt and the sampling of each pass."""
    _validate(args)
    names = [n.strip() for n in args.data_names.split(",") if n.strip()]
    if not names:
        raise EvalError("--data_names is empty")
    try:
        datasets = {n: data_loader.load_problems(n, args.data_dir, args.max_problems, args.seed) for n in names}
    except data_loader.DatasetError as e:
        raise EvalError(str(e)) from None
    try:
        model_path = engines.check_model_path(args.model_path)
    except engines.EngineError as e:
        raise EvalError(str(e)) from None
    out = os.path.abspath(args.output_path)
    os.makedirs(out, exist_ok=True)

    import transformers  # ~2 s: only once the arguments and every dataset are known to be good

    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    stop_ids = engines.stop_token_ids(model_path, tok)
    built = {n: [prompts.build_prompt(tok, p.question, args.prompt_type) for p in probs] for n, probs in datasets.items()}
    # the generation key holds the requested max_gen_tokens; the per-prompt clamp is a function of it, the model
    # and the prompts, which the key also covers (and the budgets themselves when clamped)
    return _Setup(datasets, built, model_path, engines.model_fingerprint(model_path), engines.max_positions(model_path),
                  _sampling_configs(args, stop_ids, args.max_gen_tokens), out)


def _dataset_budgets(name: str, built: List[tuple], max_gen_tokens: int, max_pos: Optional[int]) -> tuple:
    """``(max new tokens per prompt, their summary for aggregate.json)``; warns when prompts are clamped."""
    budgets = token_budgets([len(ids) for _, ids in built], max_gen_tokens, max_pos)
    n_clamped = sum(0 < b < max_gen_tokens for b in budgets)
    n_too_long = sum(b == 0 for b in budgets)
    if n_clamped or n_too_long:
        logger.warning("%s: prompt + max_gen_tokens %d exceeds the model's %d positions for %d of %d prompts: "
                       "%d get fewer new tokens (down to %d), %d fill the context alone and score 0 "
                       "(status prompt_too_long)", name, max_gen_tokens, max_pos, n_clamped + n_too_long,
                       len(budgets), n_clamped, min((b for b in budgets if b), default=0), n_too_long)
    return budgets, {"max": max(budgets, default=0), "min": min(budgets, default=0),
                     "clamped_prompts": n_clamped, "prompts_too_long": n_too_long}


def _generate_pass(engine, args, name: str, probs: List[data_loader.Problem], built: List[tuple],
                   cfg: SamplingParams, budgets: List[int]) -> List[dict]:
    """Generate one pass (prompts grouped by their token budget, largest first) and return its ungraded rows."""
    reqs = [engines.GenRequest(prompt_ids=ids, prompt_text=text, seed=problem_seed(args.seed, name, p.idx), problem=p)
            for p, (text, ids) in zip(probs, built)]
    comps: List[Optional[list]] = [None] * len(reqs)
    by_budget: Dict[int, List[int]] = {}
    for i, b in enumerate(budgets):
        if b > 0:
            by_budget.setdefault(b, []).append(i)
        else:
            comps[i] = [engines.Completion("", 0, False)] * cfg.n
    for b in sorted(by_budget, reverse=True):
        idx = by_budget[b]
        res = engine.generate([reqs[i] for i in idx], dataclasses.replace(cfg, max_new_tokens=b))
        if len(res) != len(idx) or any(len(c) != cfg.n for c in res):
            raise RuntimeError(f"engine returned {len(res)} results for {len(idx)} prompts x {cfg.n}")
        for i, c in zip(idx, res):
            comps[i] = c
    return [{"idx": p.idx, "question": p.question, "ground_truth": p.ground_truth, "prompt": r.prompt_text,
             "seed": r.seed, "max_new_tokens": b, "completions": [c.text for c in cs],
             "lengths": [c.n_tokens for c in cs], "finished": [c.finished for c in cs]}
            for p, r, cs, b in zip(probs, reqs, comps, budgets)]


def _reuse_pass(tag: str, jsonl: str, meta_path: str, gen_key: dict, probs: List[data_loader.Problem],
                pass_name: str, grader: Grader, outcome: _Outcome) -> Optional[List[dict]]:
    """The rows of a finished pass with the same generation arguments (graded again if the grading arguments
    changed), else None."""
    found = _load_reusable(jsonl, meta_path, gen_key)
    if found is None:
        return None
    rows, meta = found
    if meta.get("grading") == grader.key:
        logger.info("%s: reusing %s (same generation and grading arguments)", tag, jsonl)
    else:
        logger.info("%s: reusing the completions of %s, grading again", tag, jsonl)
        grader.grade_rows(rows, probs, pass_name)
        _save(jsonl, meta_path, rows, gen_key, grader.key)
        outcome.regraded.append(tag)
    outcome.reused.append(tag)
    return rows


def _evaluate_dataset(setup: _Setup, args, name: str, engine: _RunEngine, grader: Grader, outcome: _Outcome):
    """Each pass of one dataset: reused when a finished one matches, else generated, graded and written."""
    probs = setup.datasets[name]
    data_sha = data_loader.file_sha256(data_loader.dataset_path(name, args.data_dir))
    idx_sha = hashlib.sha256(json.dumps([p.idx for p in probs]).encode()).hexdigest()
    outcome.rows[name] = {}
    budgets, effective = _dataset_budgets(name, setup.built[name], args.max_gen_tokens, setup.max_pos)
    outcome.effective_max_new[name] = effective
    for pass_name, cfg in setup.cfgs.items():
        tag = f"{name}/{pass_name}"
        jsonl, meta_path = _paths(setup.out, name, pass_name)
        gen_key = {"dataset": name, "data_sha256": data_sha, "problems": len(probs), "problems_sha256": idx_sha,
                   "model_path": setup.model_path, "model_files": setup.fingerprint, "engine": engine.name,
                   "prompt_type": args.prompt_type, "pass": pass_name, "sampling": cfg.to_dict(),
                   "seed": args.seed if pass_name == "sample" else None}
        if effective["clamped_prompts"] or effective["prompts_too_long"]:
            gen_key["max_new_tokens_per_prompt_sha256"] = hashlib.sha256(json.dumps(budgets).encode()).hexdigest()
        _remove_stale_tmp(jsonl, meta_path)
        rows = None if args.overwrite else _reuse_pass(tag, jsonl, meta_path, gen_key, probs, pass_name, grader,
                                                       outcome)
        if rows is None:
            eng = engine.get()
            t0 = time.perf_counter()
            logger.info("%s: generating %d problems x %d answers (max %d new tokens)", tag, len(probs), cfg.n,
                        max(budgets, default=0))
            rows = _generate_pass(eng, args, name, probs, setup.built[name], cfg, budgets)
            t_gen = time.perf_counter() - t0
            grader.grade_rows(rows, probs, pass_name)
            _save(jsonl, meta_path, rows, gen_key, grader.key)
            logger.info("%s: generated in %.1fs, graded in %.1fs -> %s", tag, t_gen, time.perf_counter() - t0 - t_gen,
                        jsonl)
            outcome.generated.append(tag)
        outcome.rows[name][pass_name] = rows


def _aggregate(args, setup: _Setup, outcome: _Outcome, t_start: float) -> tuple:
    """``(metrics per dataset, the table, the contents of aggregate.json)``."""
    results = {}
    for name, passes in outcome.rows.items():
        g, s = passes.get("greedy"), passes.get("sample")
        results[name] = M.dataset_metrics(
            [r["scores"] for r in g] if g else None, [r["lengths"] for r in g] if g else None,
            [r["scores"] for r in s] if s else None, [r["lengths"] for r in s] if s else None,
            [r["maj_score"] for r in s] if s else None, args.n_sampling)
    table = M.format_table(results, args.n_sampling)
    agg = {
        "metrics": results,
        "args": {k: v for k, v in vars(args).items()},
        "model_path": setup.model_path,
        "model_files": setup.fingerprint,
        "seeds": {"base_seed": args.seed,
                  "per_problem_seed": "int.from_bytes(sha256(f'{seed}:{dataset}:{row index}')[:4], 'little') & 0x7fffffff; "
                                      "sample j draws from the stream of (problem seed, j)",
                  "subset": "random.Random(f'realhf-eval-subset:{seed}:{dataset}').sample(rows, max_problems), sorted"},
        "sampling": {k: c.to_dict() for k, c in setup.cfgs.items()},
        "effective_max_new_tokens": outcome.effective_max_new,  # after clamping to the model's positions
        "metric_notes": "accuracies are fractions in [0, 1]; lengths are generated tokens (stop token included); "
                        "pass@k unbiased estimator; maj@n votes on normalized extracted answers, ties -> first occurrence",
        "outputs": {n: {p: os.path.relpath(_paths(setup.out, n, p)[0], setup.out) for p in passes}
                    for n, passes in outcome.rows.items()},
        "generated": outcome.generated,
        "reused": outcome.reused,
        "seconds": time.perf_counter() - t_start,
    }
    return results, table, agg


def run_evaluation(args: argparse.Namespace, engine=None) -> EvalRun:
    """Evaluate ``args.model_path``; ``engine`` (an object with ``generate(requests, cfg)``) replaces
    the one named by ``args.engine`` (e.g. a fake engine in tests)."""
    setup = _resolve(args)
    run_engine = _RunEngine(engine, args, setup.model_path)
    grader = Grader(args.grade_timeout, args.grader_workers, args.allow_last_number)
    outcome = _Outcome()
    t_start = time.perf_counter()
    try:
        for name in setup.datasets:
            _evaluate_dataset(setup, args, name, run_engine, grader, outcome)
    except BaseException:
        run_engine.abort()
        raise
    finally:
        grader.close()
        run_engine.close()
    results, table, agg = _aggregate(args, setup, outcome, t_start)
    write_atomic(os.path.join(setup.out, "aggregate.json"), json.dumps(agg, indent=1, default=str).encode())
    write_atomic(os.path.join(setup.out, "table.txt"), (table + "\n").encode())
    return EvalRun(results, table, outcome.generated, outcome.reused, outcome.regraded, setup.out)


def main(argv=None, engine=None) -> int:
    """CLI entry: prints the table; returns 0, or 2 on a user error (reported before any generation)."""
    args = parse_args(argv)
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        def _term(signum, frame):
            raise SystemExit(128 + signum)  # unwinds through run_evaluation: workers are stopped

        signal.signal(signal.SIGTERM, _term)
    try:
        run = run_evaluation(args, engine=engine)
    except EvalError as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        return 2
    print(run.table, flush=True)
    return 0


def evaluate_checkpoint(model_path: str, output_path: str, data_names="math_500,aime24,amc23", engine=None,
                        **overrides) -> Dict[str, Dict[str, float]]:
    """Evaluate a checkpoint the same way as the CLI and return ``{dataset: metrics}``.

    ``overrides`` are CLI options by their dest name (``n_sampling=4, max_gen_tokens=1024, ...``).
    Raises :class:`EvalError` on a user error.
    """
    if not isinstance(data_names, str):
        data_names = ",".join(data_names)
    args = parse_args(["--model_path", model_path, "--output_path", output_path, "--data_names", data_names])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise EvalError(f"unknown evaluation option {k!r}")
        setattr(args, k, v)
    return run_evaluation(args, engine=engine).metrics
