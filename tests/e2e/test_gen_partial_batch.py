"""`gen` generates for every prompt: a prompt count that is not a multiple of the batch runs a last,
smaller batch (or, when that remainder is smaller than the data-parallel size, one larger batch) instead
of dropping it. Real runs: quickstart CLI -> local launcher -> master + model workers."""
import collections
import json
import os

import pytest

from realhf.testing import run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def model():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def _prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Ann has {i} pens and finds {i + 2} more.", "query_id": f"q{i}"}) + "\n")


def _gen(model, prompts, root, exp, layout, n_devices, *extra):
    return run_quickstart(["gen", f"model.path={model}", f"dataset.path={prompts}", "dataset.train_bs_n_seqs=4",
                           "gen.max_new_tokens=4", "use_chat_template=false", f"fileroot={root}",
                           f"experiment_name={exp}", f"allocation_mode={layout}", f"n_devices_per_node={n_devices}",
                           *extra])


@pytest.mark.parametrize("n_prompts,layout,n_devices,n_samples", [
    (7, "d1m1p1", 1, 2),  # 4 + 3: the last batch is smaller
    (5, "d2m1p1", 2, 1),  # 4 + 1: the remainder (1) is smaller than dp=2, it joins the first batch
])
def test_every_prompt_generated_exactly_once(model, tmp_path, n_prompts, layout, n_devices, n_samples):
    root = str(tmp_path)
    prompts = str(tmp_path / "prompts.jsonl")
    _prompts(prompts, n_prompts)
    out = os.path.join(root, "g", "trial0", "logs", "generated.jsonl")
    # part files an earlier, unfinished run left behind (one of a writer rank, one of a rank not in this run)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    for r in (0, 7):
        with open(f"{out}.part.{r}", "w") as f:
            f.write(json.dumps({"query_id": "stale", "sample_idx": 0, "output_ids": []}) + "\n")
    p = _gen(model, prompts, root, "g", layout, n_devices, f"gen.n={n_samples}")
    assert p.returncode == 0, p.stderr[-5000:]
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    counts = collections.Counter(r["query_id"] for r in rows)
    assert counts == {f"q{i}": n_samples for i in range(n_prompts)}, counts
    assert sorted((r["query_id"], r["sample_idx"]) for r in rows) == sorted(
        (f"q{i}", j) for i in range(n_prompts) for j in range(n_samples))
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".part." in f]


def test_fewer_prompts_than_data_parallel_ranks_fails_before_start(model, tmp_path):
    prompts = str(tmp_path / "prompts.jsonl")
    _prompts(prompts, 1)
    p = _gen(model, prompts, str(tmp_path), "g", "d2m1p1", 2, "dataset.train_bs_n_seqs=2")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "prompts.jsonl" in p.stderr and "has 1 prompts" in p.stderr and "2 data-parallel ranks" in p.stderr
    assert not os.path.exists(os.path.join(str(tmp_path), "g", "trial0", "logs", "master.log"))
