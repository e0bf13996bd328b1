"""HF checkpoint folders appear complete or not at all: ``save_hf`` writes under a staging name and renames
when every shard is written. Crashes are real: a child process saving a tiny model is SIGKILLed mid-save."""
import json
import os
import subprocess
import sys

import pytest
import torch

from realhf.base.process import env_with_source_path, source_root
from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

# Saves the tiny model (weights perturbed with ``seed`` unless it is negative) to ``dst``. With ``crash_in``
# = "copy_tokenizer" it SIGKILLs itself while the folder is being written: after the weights and
# config.json, when the tokenizer files are copied (a crash point that exists in any version of save_hf).
_CHILD = """
import os, signal, sys
from realhf.impl.model.conversion import hf_io
src, dst, seed, crash_in = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
model = hf_io.build_from_hf(src)
if seed >= 0:
    model.init_random(seed=seed, std=0.05)
if crash_in == "copy_tokenizer":
    hf_io.copy_tokenizer = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
hf_io.save_hf(model, dst, tokenizer_src=src)
"""


@pytest.fixture(scope="module")
def src():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


def _save_in_child(src, dst, seed, crash_in="", failpoints=""):
    env = dict(env_with_source_path(), REALHF_FAILPOINTS=failpoints)
    return subprocess.run([sys.executable, "-c", _CHILD, src, dst, str(seed), crash_in or "-"], cwd=source_root(),
                          env=env, capture_output=True, text=True, timeout=300)


def _save_here(src, dst, seed):
    """The save of ``_CHILD`` without a crash, in this process."""
    from realhf.impl.model.conversion import hf_io

    model = hf_io.build_from_hf(src)
    if seed >= 0:
        model.init_random(seed=seed, std=0.05)
    hf_io.save_hf(model, dst, tokenizer_src=src)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _loads(path):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert transformers.AutoTokenizer.from_pretrained(path)("1+1=")["input_ids"]
    return m


CRASHES = [dict(crash_in="copy_tokenizer"), dict(failpoints="save_hf.before_rename")]


@pytest.mark.parametrize("crash", CRASHES, ids=["while_writing", "before_rename"])
def test_crash_mid_save_leaves_no_folder_or_the_previous_one(src, tmp_path, crash):
    dst = str(tmp_path / "ckpt")
    p = _save_in_child(src, dst, 1, **crash)
    assert p.returncode == -9, p.stderr[-3000:]
    assert not os.path.exists(dst), f"a crashed save left {os.listdir(dst)} under the final name"
    # a complete checkpoint, then a crash while saving different weights over it: the first one stays
    _save_here(src, dst, 1)
    first = _weights(dst)
    p = _save_in_child(src, dst, 2, **crash)
    assert p.returncode == -9, p.stderr[-3000:]
    after = _weights(dst)
    assert after.keys() == first.keys() and all(torch.equal(after[k], first[k]) for k in first), \
        "the crashed save changed the previous checkpoint"
    _loads(dst)
    # the next save cleans up what the crash left behind, and replaces the checkpoint
    _save_here(src, dst, 2)
    assert not all(torch.equal(_weights(dst)[k], first[k]) for k in first)
    _loads(dst)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)


def test_normal_save_loads_with_transformers(src, tmp_path):
    import transformers

    dst = str(tmp_path / "out" / "ckpt")
    _save_here(src, dst, -1)
    m = _loads(dst)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, ref(ids).logits, atol=1e-5)
    assert os.listdir(tmp_path / "out") == ["ckpt"]


def test_non_finite_parameters_are_not_saved(src, tmp_path):
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    model = build_from_hf(src)
    name = next(iter(model.param_spec))
    with torch.no_grad():
        t = model.local_param(name)
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    dst = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"ckpt.*3 parameter values are not finite"):
        save_hf(model, dst, tokenizer_src=src)
    assert os.listdir(tmp_path) == []


def test_counting_non_finite_values_is_exact_also_when_a_sum_overflows():
    """n_nonfinite sums to skip counting when every value is finite: a sum that overflows from finite values
    (or one in half precision) falls back to counting and finds none."""
    from realhf.impl.model.conversion.hf_io import n_nonfinite

    big = torch.full((4,), 3e38)  # finite; their float32 sum is inf
    assert n_nonfinite([big, torch.ones(3), torch.arange(3)]) == 0
    assert n_nonfinite([torch.full((10,), 60000.0, dtype=torch.float16)]) == 0
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    assert n_nonfinite([big, bad, torch.tensor([float("nan")], dtype=torch.bfloat16)]) == 4


def _pp_save_worker(src, dst, nan_stage):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    grid = ParallelGrid(ParallelDims(pp=2))
    model = build_from_hf(src, grid=grid)
    if grid.pp_rank == nan_stage:
        with torch.no_grad():
            model.local_param(next(iter(model.param_spec))).view(-1)[0] = float("nan")
    try:
        save_hf(model, dst, tokenizer_src=src)
    except ValueError as e:
        return str(e)
    return sorted(os.listdir(os.path.dirname(dst)))


def test_pipeline_parallel_save_is_complete_and_atomic(src, tmp_path):
    dst = str(tmp_path / "ckpt")
    os.makedirs(dst)
    with open(os.path.join(dst, "stale.txt"), "w") as f:
        f.write("from an older checkpoint")
    listings = run_distributed(_pp_save_worker, 2, src, dst, -1)
    assert listings == [["ckpt"], ["ckpt"]], "every rank returns after the folder is in place"
    files = sorted(os.listdir(dst))
    assert "stale.txt" not in files and "model.safetensors.index.json" in files, files
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        assert sorted(set(json.load(f)["weight_map"].values())) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    m = _loads(dst)
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, ref(ids).logits, atol=1e-5)
    # a NaN on one stage only: every rank refuses (none waits forever) and the checkpoint stays as it was
    errors = run_distributed(_pp_save_worker, 2, src, dst, 1, timeout=120)
    assert all("1 parameter values are not finite" in e for e in errors), errors
    assert sorted(os.listdir(dst)) == files and sorted(os.listdir(tmp_path)) == ["ckpt"]
