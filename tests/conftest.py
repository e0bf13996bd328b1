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


@pytest.fixture(scope="module")
def tiny_math_run(tmp_path_factory):
    """(a tiny tied Qwen2 model, a folder holding math.jsonl with 32 'easy' arithmetic rows) for ppo-math runs."""
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.impl.model.tiny import ensure_tiny_model

    d = tmp_path_factory.mktemp("ppo")
    write_math_jsonl(make_arithmetic_problems(32, seed=3, kind="easy"), str(d / "math.jsonl"))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), d


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory):
    """(a tiny tied Qwen2 model, a folder holding train.jsonl with 16 one-digit additions) for short sft runs."""
    from realhf.testing import write_sum_rows
    from realhf.impl.model.tiny import ensure_tiny_model

    d = tmp_path_factory.mktemp("sft")
    write_sum_rows(str(d / "train.jsonl"))
    return ensure_tiny_model("qwen2", tie_word_embeddings=True), d


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
