"""The experiment spec is built once per launch: the launcher writes it beside the run's config.yaml, signed with
the launch's run secret, and every process loads it from there instead of building it again; a spec file that is not
this launch's (another launch's secret, a config file edited since) is not used: the process builds the spec from
the config file, as before, and says why in its log."""
import os

from realhf.impl.model.tiny import ensure_tiny_model
from realhf.testing import run_quickstart, sft_cmd, write_sum_rows
from support.log_lines import LogLines


def test_processes_load_the_launchers_spec_and_refuse_another_launchs(tmp_path):
    root, logs = str(tmp_path), os.path.join(str(tmp_path), "once", "trial0", "logs")
    write_sum_rows(str(tmp_path / "train.jsonl"))
    p = run_quickstart(sft_cmd(ensure_tiny_model("qwen2"), str(tmp_path), root, "once", "exp_ctrl.benchmark_steps=1"),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    spec_file, cfg_path = os.path.join(logs, "spec.pkl"), os.path.join(logs, "config.yaml")
    assert os.path.isfile(spec_file), f"the launcher wrote no spec file beside {cfg_path}: {os.listdir(logs)}"
    for proc in ("master", "model_worker_0"):
        with open(os.path.join(logs, f"{proc}.log")) as f:
            log = f.read()
        assert f"experiment spec: loaded from {spec_file}" in log, f"{proc} did not load the launcher's spec:\n{log}"
        assert "building the spec" not in log, log

    from realhf.apps.launch_spec import write_launch_files
    from realhf.apps.remote import load_config, load_run
    from realhf.base import logging as rlogging
    from realhf.base.run_secret import new_run_secret
    from realhf.experiments import build_spec

    lines = LogLines()
    rlogging.getLogger("realhf.launch_spec").addHandler(lines)
    try:
        # the launch's own file, read by a process of another launch (another secret): rebuilt from config.yaml
        config, spec = load_run("sft", cfg_path, new_run_secret())
        assert any("not signed with this run's secret" in m for m in lines.lines), lines.lines
        assert spec == build_spec("sft", load_config("sft", cfg_path)) and spec.benchmark_steps == 1
        # a file this launch signed, for a config.yaml edited since: the edited config wins
        secret, lines.lines = new_run_secret(), []
        write_launch_files(logs, "sft", config, spec, secret)
        assert load_run("sft", cfg_path, secret)[1] == spec and "loaded from" in lines.lines[-1], lines.lines
        with open(cfg_path) as f:
            text = f.read()
        assert "benchmark_steps: 1\n" in text
        with open(cfg_path, "w") as f:
            f.write(text.replace("benchmark_steps: 1\n", "benchmark_steps: 2\n"))
        edited_config, edited = load_run("sft", cfg_path, secret)
        assert any("another content of config.yaml" in m for m in lines.lines), lines.lines
        assert edited.benchmark_steps == 2 and edited_config.exp_ctrl.benchmark_steps == 2
    finally:
        rlogging.getLogger("realhf.launch_spec").removeHandler(lines)
