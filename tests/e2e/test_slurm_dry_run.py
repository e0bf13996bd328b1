"""``--dry-run`` of the seeds' GPU configs (1.5B/7B/32B on 4 and 16 nodes x 8 GPUs) under ``mode=slurm``: the printed
``sbatch`` commands ask for the nodes, tasks and GPUs the allocation says, generation and training on disjoint
devices (separate jobs that together fill the run's nodes), and nothing is submitted or written."""
import glob
import io
import os
import re
import shlex

import pytest

from realhf.base.process import source_root
from realhf.impl.model.tiny import ensure_tiny_model

ROOT = source_root()
MULTI_NODE = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "configs", "gpu", "*.yaml"))
                    if "1node" not in p)


def _flags(line):
    out = {}
    for w in shlex.split(line)[1:]:
        if w.startswith("--") and "=" in w:
            k, v = w[2:].split("=", 1)
            out[k] = v
    return out


def _plan(path, tmp_path, *extra):
    from realhf.api.quickstart.entry import load_config
    from realhf.apps.main import dry_run
    from realhf.experiments import config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    model = ensure_tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=8, hidden_size=64,
                               max_position_embeddings=32768)  # a stand-in taking every tensor size the configs use
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="add"), str(math))
    root = tmp_path / "root"
    cfg = load_config(config_class("ppo-math"), [path], [f"actor.path={model}", f"dataset.path={math}",
                                                         f"fileroot={root}", *extra])
    out = io.StringIO()
    assert dry_run("ppo-math", cfg, out) == 0
    assert not root.exists(), "a dry run writes nothing"
    return cfg, out.getvalue()


@pytest.mark.parametrize("path", MULTI_NODE, ids=[os.path.basename(p) for p in MULTI_NODE])
def test_gpu_config_dry_run_sizes_the_slurm_jobs(path, tmp_path):
    pytest.importorskip("vllm")  # the vllm. backend is checked at build time
    cfg, text = _plan(path, tmp_path, "mode=slurm", "slurm.partition=gpu", "slurm.account=rl", "slurm.time=3-00:00:00",
                      "slurm.container_image=/images/realhf.sqsh", "slurm.container_mounts=/storage:/storage",
                      "slurm.sbatch_args=--qos=high --exclusive", "slurm.srun_args=--mpi=pmix",
                      "slurm.mem_per_slot=200G", "cpus_per_worker=8")
    jobs = {}
    for line in text.splitlines():
        if line.startswith("sbatch "):
            f = _flags(line)
            jobs[f["job-name"].rsplit(":", 1)[1]] = f
    assert set(jobs) == {"gen_servers", "master", "model_workers"}, text[:3000]
    alloc = cfg.allocation()
    gen, train = jobs["gen_servers"], jobs["model_workers"]
    gen_world = alloc.gen.world_size
    tp = alloc.gen.tp
    assert int(gen["ntasks"]) == gen_world // tp and int(gen["gpus-per-task"]) == tp
    assert int(gen["nodes"]) == gen_world // 8 and int(gen["ntasks-per-node"]) == 8 // tp
    assert int(train["ntasks"]) == cfg.n_devices - gen_world and int(train["gpus-per-task"]) == 1
    assert int(train["nodes"]) == (cfg.n_devices - gen_world) // 8 and int(train["ntasks-per-node"]) == 8
    # two jobs, disjoint devices, together the run's nodes x 8 GPUs
    assert int(gen["nodes"]) + int(train["nodes"]) == cfg.n_nodes
    assert int(gen["ntasks"]) * tp + int(train["ntasks"]) == cfg.n_nodes * 8
    assert "gpus-per-task" not in jobs["master"] and "nodes" not in jobs["master"]
    assert int(train["cpus-per-task"]) == 8 and int(gen["cpus-per-task"]) == 8 * tp  # cpus_per_worker per slot
    assert train["mem-per-cpu"] == gen["mem-per-cpu"] == "25600M"  # 200G a slot over its 8 CPUs
    for f in jobs.values():  # the slurm.* options reach every job
        assert f["partition"] == "gpu" and f["account"] == "rl" and f["time"] == "3-00:00:00" and f["qos"] == "high"
    assert text.count("--exclusive") == 3
    srun = [line for line in text.splitlines() if line.startswith("exec srun ")]
    assert len(srun) == 3 and all("--container-image=/images/realhf.sqsh" in s and "--mpi=pmix" in s and
                                  "--container-mounts=/storage:/storage" in s for s in srun)
    # each task's rank picks its name and its --rank/--index; the run's secret is never printed
    assert re.search(r'--index "\$RANK"', text) and re.search(r'--rank "\$RANK"', text)
    assert "REALHF_RUN_SECRET=<a fresh secret per launch>" in text


def test_dry_run_from_the_command_line(tmp_path):
    """``quickstart ... --dry-run``: the plan on stdout, exit 0, nothing started; the local launcher prints commands."""
    from realhf.testing import run_quickstart, write_sum_rows

    write_sum_rows(str(tmp_path / "train.jsonl"))
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    base = ["sft", f"model.path={model}", f"dataset.train_path={tmp_path}/train.jsonl", "dataset.max_seqlen=512",
            f"fileroot={tmp_path}/root", "allocation_mode=d2m1p1", "n_devices_per_node=2", "--dry-run"]
    p = run_quickstart(base + ["mode=slurm", "slurm.gpus_per_slot=0"], timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"^sbatch .*--ntasks=2 .*--nodes=1 --ntasks-per-node=2 ", p.stdout, re.M), p.stdout[:2000]
    assert "--gpus-per-task" not in p.stdout
    q = run_quickstart(base, timeout=120)
    assert q.returncode == 0, q.stderr[-2000:]
    assert "# model_worker_1 (local, device slots 1..1)" in q.stdout and "--role model_worker --rank 1" in q.stdout
    r = run_quickstart(base + ["mode=ray"], timeout=120)
    assert r.returncode == 0 and "# model_worker_0 (ray, device slots 0..0)" in r.stdout, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "root")
