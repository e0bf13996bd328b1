import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def _tiny_math(d):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model

    write_math_jsonl(make_arithmetic_problems(32, seed=3, kind="easy"), str(d / "math.jsonl"))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), d


@pytest.fixture(scope="module")
def tiny_math_run(tmp_path_factory):
    """(a tiny tied Qwen2 model, a folder holding math.jsonl with 32 'easy' arithmetic rows) for ppo-math runs."""
    return _tiny_math(tmp_path_factory.mktemp("ppo"))


@pytest.fixture(scope="session")
def tiny_ppo_colocated(tmp_path_factory):
    """The stats.jsonl rows of the run of ``support.tiny_ppo`` on one device (allocation_mode=d1m1p1), over the data
    of ``tiny_math_run``: the reference, run once, of the tests that run it elsewhere and compare step for step."""
    from support.tiny_ppo import ppo_args

    from realhf.testing import read_stats, run_quickstart

    model, d = _tiny_math(tmp_path_factory.mktemp("ppo_colocated"))
    p = run_quickstart(ppo_args(model, d, "colocated", 1, "allocation_mode=d1m1p1"))
    assert p.returncode == 0, p.stderr[-4000:]
    return read_stats(str(d), "colocated")


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory):
    """(a tiny tied Qwen2 model, a folder holding train.jsonl with 16 one-digit additions) for short sft runs."""
    from realhf.testing import write_sum_rows
    from realhf.impl.model.tiny import ensure_tiny_model

    d = tmp_path_factory.mktemp("sft")
    write_sum_rows(str(d / "train.jsonl"))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), d


@pytest.fixture(scope="session")
def tiny_arith_start(tmp_path_factory):
    """The start of the tiny-arithmetic learning runs (``scripts/tiny_arith_learning.py``: the tiny model, the data, its
    SFT from scratch and the held-out greedy accuracy of that checkpoint), built once and shared by every learning test
    (tests/e2e/test_grpo_learns.py, tests/e2e/test_algorithms_learn.py); ``out`` is the folder the RL runs write to."""
    from realhf.testing import tiny_arith_recipe

    out = str(tmp_path_factory.mktemp("tiny_arith"))
    s = tiny_arith_recipe().prepare(out, eval_threads=None)
    s["out"] = out
    # about 30%: right on the problems the sloppy teacher got right (20% of them) and a few others
    assert 0.15 <= s["heldout_acc_before"] <= 0.45, s["heldout_acc_before"]
    return s


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real one-node Slurm (tests/support/slurm_cluster.py) for the session, its ``SLURM_CONF`` set in this process's
    environment (so launched runs and Slurm clients find it); skipped with the reason where it cannot be installed."""
    import os

    from support.slurm_cluster import slurm_or_skip

    s = slurm_or_skip(str(tmp_path_factory.mktemp("slurm")))
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = s.conf
    try:
        yield s
    finally:
        s.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
