"""``allocation_mode=search`` and ``python -m realhf.apps.plan ... --search``: the plan search on a tiny ppo-math
config (the written manual config loads, fits every rank by the launcher's own memory plan and is estimated as the
search estimated it), a launch that searches, then trains on the chosen plan, a refusal with exit 2 when nothing
fits, and the GPU examples planned for simulated clusters (8 GPUs here; 64, 128 and 512 GPUs ``slow``)."""
import json
import os
import subprocess
import sys

import pytest

from realhf.base.process import env_with_source_path, source_root

EXAMPLES = os.path.join(source_root(), "examples", "configs", "gpu")


def _tiny(d, model, *extra):
    return ["ppo-math", f"actor.path={model}", f"dataset.path={d}/math.jsonl", "dataset.train_bs_n_seqs=4",
            "group_size=4", "ppo.gen.max_new_tokens=6", "ppo.ppo_n_minibatches=1", "use_chat_template=false",
            "prompt_template={prompt}", "reward.allow_last_number=true", "use_critic=true", "ppo.kl_ctl=0.04",
            f"fileroot={d}", *extra]


def _run(module, args, timeout=300):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=source_root(), capture_output=True, text=True,
                          timeout=timeout, env=env_with_source_path())


def test_search_writes_a_manual_plan_that_fits_and_is_estimated_as_searched(tiny_math_run, tmp_path):
    from realhf.api.quickstart import entry
    from realhf.apps.planning import estimate
    from realhf.experiments import build_spec, registered
    from realhf.experiments.memory_plan import model_configs, workloads
    from realhf.plan import hardware
    from realhf.plan.cost import capacity
    from realhf.plan.fit import Capacity, plan

    model, d = tiny_math_run
    out = tmp_path / "plan.yaml"
    p = _run("realhf.apps.plan", _tiny(d, model, "allocation_mode=search", "n_devices_per_node=4", "--cluster",
                                       "h800x4x1", "--json", "--write", str(out), "--max-evals", "600"))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    s = res["search"]
    assert s["chosen"]["step_s"] == pytest.approx(res["step_s"], rel=1e-9)  # as launched = as searched
    assert s["chosen"]["step_s"] <= s["best_global"]["step_s"] and s["chosen"]["step_s"] <= s["heuristic"]["step_s"]
    assert res["options"]["allocation_mode"] == "manual"
    # value normalisation keeps the critic's inference on its training replica (the experiment requires it)
    assert s["chosen"]["placements"]["critic_inf"] == s["chosen"]["placements"]["critic_train"]
    # the written config loads as a manual allocation; the launcher's own memory plan of its spec fits every rank
    registered()
    name, cfg = entry.parse_cli(["ppo-math", "--config", str(out)])
    assert cfg.allocation_mode == "manual" and cfg.actor_train.parallel and cfg.ref_inf.device_mesh
    spec = build_spec(name, cfg)
    hw = hardware.get("h800")
    mem = plan(spec, model_configs(spec), workloads(cfg), Capacity("cuda", capacity(hw), hw.name))
    assert mem.calls and not mem.unfit()
    est, _ = estimate(name, cfg, ("h800", 4, 1))
    assert est.step_s == pytest.approx(res["step_s"], rel=1e-9)


def test_allocation_mode_search_launches_the_chosen_plan(tiny_math_run, tmp_path):
    model, d = tiny_math_run
    p = _run("realhf.apps.quickstart", _tiny(d, model, "allocation_mode=search", "n_devices_per_node=2",
                                             f"fileroot={tmp_path}", "exp_ctrl.benchmark_steps=1",
                                             "trial_name=searched"), timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert "# chosen" in p.stderr and "allocation_mode=search" in p.stderr, p.stderr[-3000:]
    written = tmp_path / "ppo-math" / "searched" / "searched_plan.yaml"
    text = written.read_text()
    assert "allocation_mode: manual" in text and "device_mesh: node01:" in text
    assert "1 steps" in p.stdout or "finished" in p.stdout, p.stdout[-2000:]


def test_a_search_where_nothing_fits_exits_2_naming_why(tiny_math_run):
    model, d = tiny_math_run
    p = _run("realhf.apps.plan", _tiny(d, model, "allocation_mode=search", "n_devices_per_node=2",
                                       "device_memory_gib=0.01"))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "no plan fits on 2 devices" in p.stderr and "gradient_checkpointing" in p.stderr, p.stderr


def _example(config, cluster, limit=30, evals=20000):
    p = _run("realhf.apps.plan", ["ppo-math", "--config", os.path.join(EXAMPLES, config), "--cluster", cluster,
                                  "--search", "--json", "--time-limit", str(limit), "--max-evals", str(evals)], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)["search"]
    assert s["seconds"] <= limit + 5
    assert s["chosen"]["step_s"] <= s["best_global"]["step_s"]
    if s["heuristic"]["step_s"] is not None:
        assert s["chosen"]["step_s"] <= s["heuristic"]["step_s"]
    return s


def test_gpu_example_planned_for_8_gpus():
    s = _example("grpo-qwen1.5b-1node.yaml", "h800x8x1", limit=20, evals=5000)
    assert s["config"]["step_s"] is not None  # the example's own allocation fits and is compared


@pytest.mark.slow
@pytest.mark.parametrize("config,cluster", [("grpo-qwen7b-4nodes.yaml", "h800x8x8"),
                                            ("grpo-qwen32b-16nodes.yaml", "h800x8x16"),
                                            ("grpo-qwen7b-16nodes.yaml", "h800x8x64")])
def test_gpu_examples_planned_for_large_clusters(config, cluster):
    _example(config, cluster)


def test_async_example_split_planned_for_8_gpus():
    from realhf.api.quickstart.allocation import parse_allocation_mode

    p = _run("realhf.apps.plan", ["async-ppo-math", "--config", os.path.join(EXAMPLES, "async-grpo-qwen1.5b-1node.yaml"),
                                  "--cluster", "h800x8x1", "--search", "--json"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)["search"]
    mode = parse_allocation_mode(s["chosen"]["allocation"], n_devices=8)  # servers and trainer use all 8 GPUs
    assert mode.kind == "decoupled" and mode.gen_backend == "vllm"
    assert s["chosen"]["tokens_per_s"] >= s["config"]["tokens_per_s"] > 0
    assert s["by_eta"]["1"]["tokens_per_s"] > s["by_eta"]["0"]["tokens_per_s"]
