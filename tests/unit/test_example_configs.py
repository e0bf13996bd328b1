"""Every example config parses and validates (paths pointed at local stand-ins) and builds its experiment."""
import glob
import json
import os

import pytest

from realhf.base.process import source_root
from realhf.impl.model.tiny import ensure_tiny_model

ROOT = source_root()
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))
EXP_OF = {"grpo": "ppo-math", "ppo": "ppo-math", "sft": "sft", "gen": "gen", "async": "async-ppo-math"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example_config_builds(path, tmp_path):
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    exp = EXP_OF[os.path.basename(path).split("-")[0]]
    model = ensure_tiny_model("qwen2")
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(64, seed=1, kind="add"), str(math))
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(64)))
    overrides = {
        "ppo-math": [f"actor.path={model}", f"dataset.path={math}"],
        "async-ppo-math": [f"actor.path={model}", f"dataset.path={math}"],
        "sft": [f"model.path={model}", f"dataset.train_path={sft}", f"dataset.valid_path={sft}"],
    }[exp] + [f"fileroot={tmp_path}"]
    if exp.endswith("ppo-math"):
        overrides.append(f"critic.path={model}")
    cfg = load_config(config_class(exp), [path], overrides)
    spec = build_spec(exp, cfg)
    assert spec.n_workers >= 1 and spec.mfcs


GPU_EXAMPLES = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "configs", "gpu", "*.yaml"))
                      if not os.path.basename(p).startswith("async-"))
ASYNC_GPU_EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "gpu", "async-*.yaml")))


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=[os.path.basename(p) for p in GPU_EXAMPLES])
def test_gpu_example_config_builds(path, tmp_path):
    """The GPU configs (1.5B/7B/32B on 1-16 nodes) build their experiment: the device counts add up and
    generation gets its own devices (vLLM servers). A tiny stand-in with 8 key/value heads takes every tensor
    size used."""
    pytest.importorskip("vllm")  # the vllm. backend is checked at build time
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    model = ensure_tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=8, hidden_size=64,
                               max_position_embeddings=32768)  # the GPU configs ask for 28672 positions
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(64, seed=1, kind="add"), str(math))
    cfg = load_config(config_class("ppo-math"), [path], [f"actor.path={model}", f"dataset.path={math}",
                                                         f"fileroot={tmp_path}"])
    spec = build_spec("ppo-math", cfg)
    assert cfg.dataset.train_bs_n_seqs == 512 and cfg.group_size in (16, 32)
    # generation servers on their own GPUs (after the trainer's), the model workers on the rest
    fleet = spec.served().gen_servers
    assert spec.served().realloc_from == "actor" and fleet.backend == "vllm"
    assert spec.device_slots() == cfg.n_nodes * 8 and fleet.first_slot == spec.n_workers
    assert fleet.n_servers * fleet.tp == cfg.allocation().gen.world_size
    assert len(spec.model("actor").ranks) == spec.n_workers


@pytest.mark.parametrize("path", ASYNC_GPU_EXAMPLES, ids=[os.path.basename(p) for p in ASYNC_GPU_EXAMPLES])
def test_async_gpu_example_config_builds(path, tmp_path):
    """The asynchronous GPU config builds its experiment: servers on their own GPUs, the trainer on the rest."""
    pytest.importorskip("vllm")
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    model = ensure_tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=8, hidden_size=64,
                               max_position_embeddings=32768)
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(128, seed=1, kind="add"), str(math))
    cfg = load_config(config_class("async-ppo-math"), [path], [f"actor.path={model}", f"dataset.path={math}",
                                                               f"fileroot={tmp_path}"])
    spec = build_spec("async-ppo-math", cfg)
    fleet = spec.served().gen_servers
    assert fleet.backend == "vllm" and fleet.first_slot == spec.n_workers
    assert fleet.n_servers * fleet.tp + spec.n_workers == cfg.n_nodes * cfg.n_devices_per_node
    assert cfg.async_rl.max_head_offpolicyness >= 1


def test_compile_options_reach_the_workers(tmp_path):
    """``actor.compile`` marks the actor's replicas (not the reference), and ``ppo.gen.compile_decode`` reaches
    the generation MFC's interface."""
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl
    from realhf.system.trainer.model_worker import make_interfaces

    model = ensure_tiny_model("qwen2")
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="add"), str(math))
    base = [f"actor.path={model}", f"dataset.path={math}", f"fileroot={tmp_path}", "ppo.kl_ctl=0.1"]
    for on in (False, True):
        flags = [f"actor.compile={str(on).lower()}", f"ppo.gen.compile_decode={str(on).lower()}"]
        spec = build_spec("ppo-math", load_config(config_class("ppo-math"), [], base + flags))
        assert spec.model("actor").compile is on and spec.model("ref").compile is False
        assert make_interfaces(spec.mfcs)["actor_gen"].gconfig.compile_decode is on
