"""evaluation/: metrics, datasets and prompts, reference-solution runs, resumable end-to-end runs."""
import itertools
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from realhf.evaluation import data_loader, prompts  # noqa: E402
from realhf.evaluation.engine import Completion  # noqa: E402
from realhf.evaluation.metrics import majority_vote, pass_at_k  # noqa: E402
from realhf.evaluation.runner import evaluate_checkpoint, main, problem_seed, run_evaluation, parse_args  # noqa: E402
from realhf.impl.model.tiny import ensure_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_model("qwen2")


# ---------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------


def _brute_pass_at_k(n, c, k):
    flags = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 1, 8) == 1.0  # k = n: any correct sample is drawn
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    # large n stays finite and in [0, 1] (no huge binomials)
    v = pass_at_k(1024, 1, 16)
    assert v == pytest.approx(16 / 1024)
    assert 0.0 <= pass_at_k(10000, 37, 500) <= 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_vote_ties_and_grouping():
    # clear winner
    assert majority_vote(["1", "2", "2", None]) == (1, "2")
    # tie: the answer whose first occurrence comes first wins, whatever the order of the rest
    assert majority_vote(["3", "5", "5", "3"]) == (0, "3")
    assert majority_vote(["5", "3", "3", "5"]) == (0, "5")
    assert majority_vote([None, "7", "9"]) == (1, "7")
    # answers without an answer do not vote; none at all -> no vote
    assert majority_vote([None, None]) == (None, None)
    assert majority_vote([]) == (None, None)
    # normalised forms vote together: "\frac{1}{2}" and "1/2"-style spacing differences
    idx, ans = majority_vote(["4", " 0.5", "0.5 ", "4"], k=3)
    assert idx == 1 and ans.strip() == "0.5"


# ---------------------------------------------------------------------------------------------------
# datasets and prompts
# ---------------------------------------------------------------------------------------------------


def test_ground_truth_per_dataset():
    m = data_loader.load_problems("math_500")
    assert len(m) == 500 and m[0].ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)"
    g = data_loader.load_problems("gsm8k")
    assert g[0].ground_truth == "18" and "####" in g[0].solutions[0]
    a = data_loader.load_problems("amc23")
    assert a[0].ground_truth == "27"  # 27.0 in the file
    assert len(data_loader.load_problems("aime25")) == 30


def test_subset_is_fixed_by_seed():
    a = [p.idx for p in data_loader.load_problems("math_500", max_problems=20, seed=3)]
    b = [p.idx for p in data_loader.load_problems("math_500", max_problems=20, seed=3)]
    c = [p.idx for p in data_loader.load_problems("math_500", max_problems=20, seed=4)]
    assert a == b and a != c and len(a) == 20 and a == sorted(a)
    assert problem_seed(1, "aime24", 5) == problem_seed(1, "aime24", 5) != problem_seed(2, "aime24", 5)


def test_unknown_dataset_lists_available(tiny, tmp_path, capsys):
    with pytest.raises(data_loader.DatasetError, match="math_500"):
        data_loader.load_problems("nope")
    rc = main(["--model_path", tiny, "--output_path", str(tmp_path), "--data_names", "aime24,nope"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope" in err and "aime24, aime25, amc23, gsm8k, math_500" in err
    assert not os.path.exists(tmp_path / "aime24")


def test_prompt_types(tiny):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    q = "What is 1+1?"
    text, ids = prompts.build_prompt(tok, q, "qwen-boxed")
    assert text.startswith("<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert text.endswith("<|im_start|>assistant\n") and ids == tok(text, add_special_tokens=False)["input_ids"]
    text, _ = prompts.build_prompt(tok, q, "r1-distill")
    assert text.endswith("<|im_start|>assistant\n<think>\n") and "\\boxed{}" in text
    text, ids = prompts.build_prompt(tok, q, "plain")
    assert text == q
    tok.chat_template = None  # no template: plain text fallback
    text, _ = prompts.build_prompt(tok, q, "qwen-boxed")
    assert "<|im_start|>" not in text and text.startswith(q + "\nPlease reason")
    with pytest.raises(ValueError):
        prompts.build_prompt(tok, q, "nope")


def test_grader_allow_last_number():
    from realhf.evaluation.runner import Grader

    texts = ["so we get 42 apples", "\\boxed{41} but maybe 42", "no number here"]
    sols = [["42"], ["42"], ["42"]]
    g = Grader(timeout=5.0, workers=1, allow_last_number=False)
    try:
        answers, scores, _ = g.grade(texts, sols)
        assert answers == [None, "41", None] and scores == [False, False, False]
        g.allow_last_number = True
        answers, scores, _ = g.grade(texts, sols)
        assert answers == ["42", "41", None] and scores == [True, False, False]
    finally:
        g.close()


# ---------------------------------------------------------------------------------------------------
# fake engines
# ---------------------------------------------------------------------------------------------------


class ReferenceEngine:
    """Answers with the dataset's own solution (MATH-500, GSM8K) or ``\\boxed{answer}``."""

    name = "reference"

    def __init__(self):
        self.n_calls = 0

    def generate(self, requests, cfg):
        self.n_calls += 1
        out = []
        for r in requests:
            p = r.problem
            sol = p.solutions[0]
            text = sol if sol != p.ground_truth else f"So the final answer is $\\boxed{{{p.ground_truth}}}$."
            out.append([Completion(text, len(text.split()), True) for _ in range(cfg.n)])
        return out

    def close(self):
        pass


class MustNotRun:
    def __init__(self, name="realhf"):
        self.name = name  # the engine name is part of the generation arguments

    def generate(self, requests, cfg):
        raise AssertionError("the engine was called although outputs should be reused")

    def close(self):
        pass


def test_reference_solutions_score_100(tiny, tmp_path):
    import shutil

    # the tiny model's tokenizer and chat template, with a context long enough for every prompt (the tiny
    # model has 512 positions; prompts that do not fit would not be generated and would score 0)
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    cfg = json.load(open(model / "config.json"))
    cfg["max_position_embeddings"] = 32768
    (model / "config.json").write_text(json.dumps(cfg))
    tiny = str(model)
    eng = ReferenceEngine()
    names = data_loader.KNOWN_DATASETS
    args = parse_args(["--model_path", tiny, "--output_path", str(tmp_path), "--data_names", ",".join(names),
                       "--max_problems", "60", "--n_sampling", "2", "--max_gen_tokens", "8"])
    run = run_evaluation(args, engine=eng)
    assert set(run.metrics) == set(names)
    for name, m in run.metrics.items():
        assert m["num_questions"] == (30 if name.startswith("aime") else 40 if name == "amc23" else 60)
        assert m["greedy_acc"] >= 0.99, (name, m)
        assert m["sample_pass@1"] >= 0.99 and m["pass@2"] >= 0.99 and m["maj@2"] >= 0.99, (name, m)
    agg = json.load(open(tmp_path / "aggregate.json"))
    assert agg["seeds"]["base_seed"] == 1 and agg["args"]["max_problems"] == 60
    # evaluate_checkpoint: same code path, returns the metrics (all reused here)
    m = evaluate_checkpoint(tiny, str(tmp_path), data_names=["aime24"], engine=MustNotRun("reference"),
                            max_problems=60, n_sampling=2, max_gen_tokens=8)
    assert m["aime24"]["greedy_acc"] == 1.0


# ---------------------------------------------------------------------------------------------------
# end to end on a tiny random model, resumability
# ---------------------------------------------------------------------------------------------------

E2E = ["--data_names", "math_500,aime24", "--max_problems", "3", "--n_sampling", "2", "--max_gen_tokens", "8"]


def _mtimes(out):
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(out) for f in fs if f.endswith(".jsonl")}


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_end_to_end_tiny_model_and_reuse(tiny, tmp_path, capsys):
    out = str(tmp_path / "out")
    argv = ["--model_path", tiny, "--output_path", out] + E2E
    assert main(argv) == 0  # realhf engine, 1 spawned worker
    table1 = capsys.readouterr().out
    assert "dataset" in table1 and "math_500" in table1 and "aime24" in table1 and "maj@2" in table1
    for name in ("math_500", "aime24"):
        for p in ("greedy", "sample"):
            rows = _rows(os.path.join(out, name, f"{p}.jsonl"))
            assert len(rows) == 3
            n = 1 if p == "greedy" else 2
            assert all(len(r["completions"]) == len(r["scores"]) == len(r["lengths"]) == n for r in rows)
            assert all(1 <= x <= 8 for r in rows for x in r["lengths"])
    agg = json.load(open(os.path.join(out, "aggregate.json")))
    assert agg["metrics"]["aime24"]["greedy_acc"] <= 1 / 3 and agg["args"]["seed"] == 1
    before = _mtimes(out)
    sample1 = _rows(os.path.join(out, "aime24", "sample.jsonl"))

    # same arguments: nothing is generated, same table
    assert main(argv, engine=MustNotRun()) == 0
    assert capsys.readouterr().out == table1
    assert _mtimes(out) == before

    # --overwrite regenerates (2 data-parallel workers, batches of 1): the same seeded samples
    from realhf.evaluation.engine import RealhfEngine

    eng = RealhfEngine(tiny, n_workers=2, threads_per_worker=1, batch_size=1)
    try:
        args = parse_args(argv + ["--overwrite", "--batch_size", "1", "--n_workers", "2"])
        run = run_evaluation(args, engine=eng)
    finally:
        eng.close()
    assert eng.n_calls == 4 and len(run.generated) == 4 and not run.reused
    after = _mtimes(out)
    assert all(after[k] != before[k] for k in before)
    sample2 = _rows(os.path.join(out, "aime24", "sample.jsonl"))
    assert [r["completions"] for r in sample2] == [r["completions"] for r in sample1]
    assert run.table == table1.strip("\n")


def test_changed_arguments_and_interrupted_files(tiny, tmp_path):
    out = str(tmp_path)
    base = ["--model_path", tiny, "--output_path", out, "--data_names", "aime24,amc23", "--max_problems", "4",
            "--n_sampling", "2", "--max_gen_tokens", "8"]
    eng = ReferenceEngine()
    run = run_evaluation(parse_args(base), engine=eng)
    assert len(run.generated) == 4 and eng.n_calls == 4

    # grading arguments changed: completions reused, graded again
    run = run_evaluation(parse_args(base + ["--allow_last_number"]), engine=MustNotRun("reference"))
    assert sorted(run.regraded) == sorted(run.reused) and len(run.reused) == 4

    # generation arguments changed: regenerated (only the sampled pass depends on the seed)
    eng = ReferenceEngine()
    run = run_evaluation(parse_args(base + ["--allow_last_number", "--temperature", "0.7"]), engine=eng)
    assert sorted(run.generated) == ["aime24/sample", "amc23/sample"]

    # an "interrupted" run: a leftover tmp file and a jsonl whose sidecar was never written
    g = os.path.join(out, "aime24", "greedy.jsonl")
    os.unlink(os.path.join(out, "aime24", "greedy.meta.json"))
    os.replace(g, g + ".x1y2.tmp")
    with open(os.path.join(out, "amc23", "greedy.jsonl"), "a") as f:
        f.write('{"idx": 0, "completions": ["\\\\boxed{1}"]}\n')  # edited / half-written content
    eng = ReferenceEngine()
    run = run_evaluation(parse_args(base + ["--allow_last_number", "--temperature", "0.7"]), engine=eng)
    assert sorted(run.generated) == ["aime24/greedy", "amc23/greedy"]
    assert len(_rows(g)) == 4 and run.metrics["aime24"]["greedy_acc"] == 1.0
    assert not [f for f in os.listdir(os.path.join(out, "aime24")) if f.endswith(".tmp")]


def test_max_gen_tokens_clamped_to_model_positions(tiny, tmp_path):
    seen = []

    class Recording(ReferenceEngine):
        def generate(self, requests, cfg):
            seen.append((max(len(r.prompt_ids) for r in requests), cfg.max_new_tokens))
            return super().generate(requests, cfg)

    run = run_evaluation(parse_args(["--model_path", tiny, "--output_path", str(tmp_path), "--data_names", "aime24",
                                     "--max_problems", "2", "--n_sampling", "0", "--max_gen_tokens", "32768"]),
                         engine=Recording())
    max_pos = json.load(open(os.path.join(tiny, "config.json")))["max_position_embeddings"]
    assert seen and all(max_pos * 7 / 8 <= p + m <= max_pos for p, m in seen)
    assert run.metrics["aime24"]["greedy_acc"] == 1.0


def test_max_gen_tokens_clamped_per_prompt(tiny, tmp_path):
    """Only prompts that would run past the model's positions get fewer new tokens; a prompt that fills the
    context alone is not generated and scores 0; the budget of a prompt does not depend on the others."""
    from realhf.evaluation.runner import token_budgets

    assert token_budgets([10, 400, 497, 500, 511, 512, 900], 16, 512) == [16, 16, 15, 12, 1, 0, 0]
    assert token_budgets([100, 835, 4095], 32768, 4096) == [3840, 3072, 1]
    assert token_budgets([5000], 8, None) == [8]
    max_pos = json.load(open(os.path.join(tiny, "config.json")))["max_position_embeddings"]
    d = tmp_path / "data" / "mixed"
    d.mkdir(parents=True)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    n = max_pos
    while len(prompts.build_prompt(tok, " ".join(["seven"] * n), "qwen-boxed")[1]) > max_pos - 20:
        n -= 1  # a question that leaves fewer than 20 positions for the answer
    rows = [{"question": "What is 1+1?", "answer": "2"}, {"question": " ".join(["seven"] * max_pos), "answer": "3"},
            {"question": " ".join(["seven"] * n), "answer": "4"}]
    d.joinpath("test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    class Recording(ReferenceEngine):
        def generate(self, requests, cfg):
            seen.append(([r.problem.idx for r in requests], cfg.max_new_tokens))
            return super().generate(requests, cfg)

    run = run_evaluation(parse_args(["--model_path", tiny, "--output_path", str(tmp_path / "o"), "--data_dir",
                                     str(tmp_path / "data"), "--data_names", "mixed", "--n_sampling", "0",
                                     "--max_gen_tokens", "64"]), engine=Recording())
    budgets = {i: m for ids, m in seen for i in ids}
    assert budgets[0] == 64 and 1 <= budgets[2] < 64 and 1 not in budgets
    out = [json.loads(l) for l in open(tmp_path / "o" / "mixed" / "greedy.jsonl")]
    assert out[1]["max_new_tokens"] == 0 and out[1]["status"] == ["prompt_too_long"] and out[1]["scores"] == [False]
    assert run.metrics["mixed"]["num_questions"] == 3 and run.metrics["mixed"]["greedy_acc"] == pytest.approx(2 / 3)


def test_model_path_errors(tmp_path, capsys):
    eng = ReferenceEngine()
    rc = main(["--model_path", str(tmp_path / "missing"), "--output_path", str(tmp_path / "o"),
               "--data_names", "aime24"], engine=eng)
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    empty = tmp_path / "ckpt"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    rc = main(["--model_path", str(empty), "--output_path", str(tmp_path / "o"), "--data_names", "aime24"], engine=eng)
    assert rc == 2 and "safetensors" in capsys.readouterr().err
    assert main(["--output_path", str(tmp_path / "o"), "--data_names", "aime24"], engine=eng) == 2
    assert eng.n_calls == 0


def test_vllm_missing_is_a_clear_error(tiny, tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    rc = main(["--model_path", tiny, "--output_path", str(tmp_path), "--data_names", "aime24", "--engine", "vllm",
               "--max_problems", "1", "--n_sampling", "0", "--max_gen_tokens", "4"])
    assert rc == 2 and "pip install vllm" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "aime24" / "greedy.jsonl")


def test_realhf_math_rows_and_chat_prompt(tmp_path):
    """A dataset of realhf math rows {query_id, prompt, solutions} (e.g. the main job's held-out file) loads,
    and prompt_type 'chat' puts the bare question in the chat template, as the main job trains."""
    from realhf.evaluation.data_loader import load_problems
    from realhf.evaluation.prompts import build_prompt
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import tiny_tokenizer

    (tmp_path / "arith").mkdir()
    rows = make_arithmetic_problems(5, seed=2, kind="add")
    write_math_jsonl(rows, str(tmp_path / "arith" / "test.jsonl"))
    probs = load_problems("arith", data_dir=str(tmp_path))
    assert [p.question for p in probs] == [r["prompt"] for r in rows]
    assert [p.ground_truth for p in probs] == [r["solutions"][0] for r in rows]
    tok = tiny_tokenizer("bpe")
    text, ids = build_prompt(tok, rows[0]["prompt"], "chat")
    expect = tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], add_generation_prompt=True, tokenize=False)
    assert text == expect and "step by step" not in text and ids


def test_generation_servers_give_the_realhf_engines_results(tiny, tmp_path, capsys):
    """--allocation gen.d2m1p1: two realhf generation servers driven by the generation client; each problem's
    seeded samples are those of the in-process engine, whatever server serves them."""
    ref, got = str(tmp_path / "ref"), str(tmp_path / "servers")
    assert main(["--model_path", tiny, "--output_path", ref, "--n_workers", "0"] + E2E) == 0
    table = capsys.readouterr().out
    assert main(["--model_path", tiny, "--output_path", got, "--allocation", "gen.d2m1p1"] + E2E) == 0
    assert capsys.readouterr().out == table
    for name in ("math_500", "aime24"):
        for p in ("greedy", "sample"):
            a, b = _rows(os.path.join(ref, name, f"{p}.jsonl")), _rows(os.path.join(got, name, f"{p}.jsonl"))
            assert [r["completions"] for r in b] == [r["completions"] for r in a], (name, p)
    logs = sorted(os.listdir(os.path.join(got, "gen_servers")))
    assert "gen_server_0.log" in logs and "gen_server_1.log" in logs
    assert main(["--model_path", tiny, "--output_path", got, "--allocation", "gen.2"] + E2E) == 2
    assert "--allocation must look like vllm.d2m1p1" in capsys.readouterr().err


def test_allocation_reads_the_layout_as_training_allocations_do(tiny, tmp_path, capsys):
    """--allocation's layout follows the allocation grammar (letters in any order, a missing one is 1): servers are
    d, tensor parallelism m; a pipelined layout is refused with the reason."""
    from realhf.evaluation.runner import _validate

    args = parse_args(["--model_path", tiny, "--output_path", str(tmp_path), "--allocation", "vllm.m2d3"])
    _validate(args)
    assert (args.engine, args.n_servers, args.tensor_parallel_size) == ("vllm", 3, 2)
    assert main(["--model_path", tiny, "--output_path", str(tmp_path), "--allocation", "gen.d2m1p2"] + E2E) == 2
    err = capsys.readouterr().err
    assert "--allocation must look like vllm.d2m1p1" in err and "generation servers are not pipelined" in err, err
