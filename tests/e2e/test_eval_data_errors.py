"""``evaluation/eval_and_aggregate.py`` on bad data files: every problem is ``error: FILE:LINE: ...`` on stderr with
exit code 2, found before a model is loaded, and no output is written (not even for a good dataset named first).

Each case runs the real script as a subprocess against a real tiny checkpoint; they run side by side, once."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from realhf.base.process import source_root

ROOT = source_root()
SCRIPT = os.path.join(ROOT, "evaluation", "eval_and_aggregate.py")
GOOD = json.dumps({"problem": "What is 1 + 1?", "answer": "2"})

# case: (lines of its test.jsonl, the line named, what the message says)
CASES = {
    "list_row": ([GOOD, "[1, 2]"], 2, "expected a JSON object, got list"),
    "string_row": (['"What is 1 + 1?"'], 1, "expected a JSON object, got string"),
    "number_row": ([GOOD, "", "3"], 3, "expected a JSON object, got integer"),
    "lone_surrogate": ([GOOD, '{"problem": "What is 1 + 1?\\ud800", "answer": "2"}'], 2,
                       "field 'problem' holds a lone surrogate"),
    "empty_file": ([], 1, "no rows"),
    "no_question": ([GOOD, json.dumps({"answer": "2"})], 2, "no question"),
    "answer_is_a_list": ([json.dumps({"problem": "What is 1 + 1?", "answer": [2]})], 1,
                         "field 'answer' must be a string or number"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (exit code, stderr, data file, output folder)}: the script run on a good dataset and the case's."""
    from realhf.impl.model.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2")
    tmp = tmp_path_factory.mktemp("evaldata")
    data = tmp / "data"
    shutil.copytree(os.path.join(ROOT, "evaluation", "data", "amc23"), data / "good")
    procs = {}
    for case, (lines, _, _) in CASES.items():
        (data / case).mkdir(parents=True)
        path = data / case / "test.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        out = tmp / f"out_{case}"
        # small generation settings so that a run which wrongly goes on ends quickly
        cmd = [sys.executable, SCRIPT, "--model_path", model, "--output_path", str(out), "--data_dir", str(data),
               "--data_names", f"good,{case}", "--n_workers", "0", "--n_sampling", "0", "--max_gen_tokens", "2",
               "--max_problems", "1"]
        procs[case] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp)),
                       str(path), str(out))
    results = {}
    for case, (p, path, out) in procs.items():
        try:
            _, err = p.communicate(timeout=300)
        finally:
            p.kill()
        results[case] = (p.returncode, err, path, out)
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_bad_evaluation_data_is_named_by_file_and_line_with_exit_2(runs, case):
    rc, err, path, out = runs[case]
    _, line, what = CASES[case]
    assert rc == 2, f"exit code {rc}; stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    (msg,) = [m for m in err.splitlines() if m.startswith("error: ")]
    assert msg.startswith(f"error: {path}:{line}: "), msg
    assert what in msg, msg
    assert not os.path.exists(out), f"{out} was written: {os.listdir(out)}"
