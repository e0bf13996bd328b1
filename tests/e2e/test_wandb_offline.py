"""wandb in offline mode (no network): the master's stats go to a local wandb run under the log dir."""
import glob
import json
import os

import pytest

from realhf.testing import run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model


def test_sft_logs_to_an_offline_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(16)))
    args = ["sft", f"model.path={ensure_tiny_model('qwen2')}", "dataset.max_seqlen=512", f"dataset.train_path={data}", "dataset.train_bs_n_seqs=4",
            f"fileroot={tmp_path}", "experiment_name=wb", "exp_ctrl.benchmark_steps=3", "wandb.mode=offline",
            "wandb.tags=[cpu,test]"]
    p = run_quickstart(args, timeout=300, env={"WANDB_SILENT": "true", "WANDB_API_KEY": None})
    assert p.returncode == 0, p.stderr[-3000:]
    runs = glob.glob(str(tmp_path / "wb" / "trial0" / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path / "wb" / "trial0" / "logs")
    blob = open(runs[0], "rb").read()
    assert b"loss" in blob and b"wb" in blob  # the step stats and the project name are in the run file


def test_wandb_without_the_package_is_a_config_error(tmp_path, monkeypatch):
    import builtins

    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import config_class

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = load_config(config_class("sft"), [], [f"model.path={ensure_tiny_model('qwen2')}", "dataset.max_seqlen=512", f"dataset.train_path={data}",
                                                f"fileroot={tmp_path}", "wandb.mode=offline"])
    with pytest.raises(ValueError, match="needs the wandb package"):
        cfg.wandb_init_kwargs()
