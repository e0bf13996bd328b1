import dataclasses
from typing import List

import pytest

from realhf.api.quickstart import config as qc
from realhf.api.quickstart import entry
from realhf.api.quickstart.entry import ConfigError, HelpRequested, load_config, parse_cli


@pytest.fixture
def paths(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return str(model), str(data)


@pytest.fixture
def registered():
    """A tiny example experiment, registered for the test only."""

    @dataclasses.dataclass
    class ToyConfig(qc.SFTConfig):
        """A toy SFT-like experiment for tests."""

        toy_factor: float = dataclasses.field(default=0.5, metadata={"help": "a toy factor in [0, 1]"})

        def __post_init__(self):
            super().__post_init__()
            if not 0 <= self.toy_factor <= 1:
                raise ValueError(f"toy_factor={self.toy_factor} is not allowed; expected [0, 1]")

    calls = []
    entry.register_quickstart_exp("toy-sft", ToyConfig)
    entry.register_quickstart_exp("toy-gen", qc.GenerationExpConfig)
    yield calls
    entry._EXPERIMENTS.pop("toy-sft", None)
    entry._EXPERIMENTS.pop("toy-gen", None)


def _base_args(paths):
    return [f"model.path={paths[0]}", f"dataset.train_path={paths[1]}"]


def test_every_field_has_help():
    for cls in (qc.BaseExperimentConfig, qc.SFTConfig, qc.GenerationExpConfig, qc.PPOMathConfig):
        for opt in entry.config_options(cls):
            if not opt.key.startswith(("model.optimizer", "actor.optimizer", "critic.optimizer")):
                assert opt.help, opt.key


def test_defaults_valid(paths, tmp_path, monkeypatch):
    c = qc.BaseExperimentConfig()
    assert c.allocation().default.world_size == 1
    monkeypatch.setenv("REALHF_FILEROOT", str(tmp_path / "root"))
    c = qc.BaseExperimentConfig(experiment_name="e", trial_name="t")
    assert c.log_dir() == str(tmp_path / "root" / "e" / "t" / "logs")
    assert c.ckpt_dir().startswith(str(tmp_path / "root" / "e" / "t"))
    assert c.recover_dir().endswith("recover")
    sft = qc.SFTConfig(model=qc.ModelTrainEvalConfig(path=paths[0]),
                       dataset=qc.PromptAnswerDatasetConfig(train_path=paths[1]))
    assert sft.mfc_names() == ["trainDefault"]
    ppo = qc.PPOMathConfig(actor=qc.ModelTrainEvalConfig(path=paths[0]),
                           dataset=qc.PromptOnlyDatasetConfig(path=paths[1]))
    assert ppo.ref_path() == paths[0] and ppo.critic_path() == paths[0]
    assert "critic_train" in ppo.mfc_names() and "ref_inf" in ppo.mfc_names()
    gen = qc.GenerationExpConfig(model=qc.ModelConfig(path=paths[0]), dataset=qc.PromptOnlyDatasetConfig(path=paths[1]))
    assert gen.output_path().endswith("generated.jsonl")
    assert gen.gen.to_hyperparameters().max_new_tokens == 256


def test_grpo_mfcs(paths):
    ppo = qc.PPOMathConfig(actor=qc.ModelTrainEvalConfig(path=paths[0]), dataset=qc.PromptOnlyDatasetConfig(path=paths[1]),
                           use_critic=False, group_size=4, ppo=qc.PPOHyperparameters(kl_ctl=0.0, group_adv_norm=True))
    assert ppo.mfc_names() == ["actor_gen", "rew_inf", "actor_train"]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["model.optimizer.lr=-1e-4"], ["model.optimizer.lr", "-0.0001"]),
        (["model.dtype=fp16"], ["model.dtype", "'fp16'", "float32", "bfloat16"]),
        (["seed=abc"], ["seed", "'abc'", "int"]),
        (["mode=k8s"], ["mode", "'k8s'", "local"]),
        (["recover_mode=maybe"], ["recover_mode", "auto"]),
        (["exp_ctrl.save_freq_steps=0"], ["exp_ctrl.save_freq_steps", "0", ">= 1"]),
        (["experiment_name=a/b"], ["experiment_name", "'a/b'"]),
        (["n_devices_per_node=2", "allocation_mode=d2", "dataset.train_bs_n_seqs=1"],
         ["dataset.train_bs_n_seqs=1", "data-parallel size 2", ">= 2"]),
        (["n_devices_per_node=2", "allocation_mode=d4"], ["allocation_mode", "uses 4 devices", "has 2"]),
        (["allocation_mode=trainDefalt:d1,*:d1"], ["unknown MFC 'trainDefalt'", "trainDefault"]),
        (["dataset.train_path=/nonexistent/x.jsonl"], ["dataset.train_path", "/nonexistent/x.jsonl", "no such file"]),
        (["model.path=/nonexistent/model"], ["model.path", "/nonexistent/model"]),
        (["dataset.valid_path=/nonexistent/v.jsonl"], ["dataset.valid_path"]),
        (["model.optimizer.lrr=1e-4"], ["unknown config key 'model.optimizer.lrr'", "model.optimizer.lr"]),
        (["lr=1e-4"], ["unknown config key 'lr'", "model.optimizer.lr"]),
        (["model.path.x=1"], ["'model.path' is a value, not a section"]),
        (["toy_factor=2"], ["toy_factor=2", "[0, 1]"]),
        (["cpus_per_worker=4", "cpus_per_worker_max=2"], ["cpus_per_worker_max=2", "below cpus_per_worker=4"]),
        (["+seed=1"], ["plain key=value"]),
        (["seed=[1,2"], ["seed=[1,2"]),
    ],
)
def test_bad_overrides(paths, registered, overrides, fragments):
    with pytest.raises(ConfigError) as ei:
        parse_cli(["toy-sft"] + _base_args(paths) + overrides)
    msg = str(ei.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_required_paths(paths, registered):
    with pytest.raises(ConfigError, match="model.path is required"):
        parse_cli(["toy-sft", f"dataset.train_path={paths[1]}"])
    with pytest.raises(ConfigError, match="dataset.train_path is required"):
        parse_cli(["toy-sft", f"model.path={paths[0]}"])


def test_yaml_and_override_precedence(paths, registered, tmp_path):
    y1 = tmp_path / "a.yaml"
    y1.write_text(f"model:\n  path: {paths[0]}\n  optimizer:\n    lr: 3.0e-4\ndataset:\n  train_path: {paths[1]}\n"
                  "seed: 5\nwandb:\n  tags: [x, y]\n")
    y2 = tmp_path / "b.yaml"
    y2.write_text("seed: 6\n")
    name, cfg = parse_cli(["toy-sft", "--config", str(y1)])
    assert name == "toy-sft"
    assert isinstance(cfg, qc.SFTConfig) and isinstance(cfg.model, qc.ModelTrainEvalConfig)
    assert cfg.model.optimizer.lr == 3e-4 and cfg.seed == 5 and cfg.wandb.tags == ["x", "y"]
    assert cfg.experiment_name == "toy-sft"  # defaults to the registered name
    _, cfg = parse_cli(["toy-sft", f"--config={y1}", "--config", str(y2), "model.optimizer.lr=1e-4", "toy_factor=0.25"])
    assert cfg.model.optimizer.lr == 1e-4 and cfg.seed == 6 and cfg.toy_factor == 0.25
    # strings are taken verbatim: commas and '*' need no quoting
    _, cfg = parse_cli(["toy-sft", f"--config={y1}", "n_devices_per_node=2", "allocation_mode=trainDefault:d2,*:d1",
                        "exp_ctrl.save_freq_steps=10", "tensorboard.path=null", "experiment_name=my-exp"])
    assert cfg.allocation_mode == "trainDefault:d2,*:d1" and cfg.exp_ctrl.save_freq_steps == 10
    assert cfg.tensorboard.path is None and cfg.experiment_name == "my-exp"
    assert cfg.allocation().layout_of("trainDefault").dp == 2
    # round trip through YAML
    y3 = tmp_path / "c.yaml"
    y3.write_text(entry.config_to_yaml(cfg))
    _, cfg2 = parse_cli(["toy-sft", "--config", str(y3)])
    assert cfg2 == cfg


def test_bad_yaml(paths, registered, tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text(f"model:\n  path: {paths[0]}\n  optimiser:\n    lr: 1.0\n")
    with pytest.raises(ConfigError) as ei:
        parse_cli(["toy-sft", "--config", str(y)])
    assert "model.optimiser" in str(ei.value) and "model.optimizer" in str(ei.value) and str(y) in str(ei.value)
    y.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_cli(["toy-sft", "--config", str(y)])
    y.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        parse_cli(["toy-sft", "--config", str(y)])
    y.write_text("seed: notanint\n")
    with pytest.raises(ConfigError, match="seed"):
        parse_cli(["toy-sft", "--config", str(y)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cli(["toy-sft", "--config", str(tmp_path / "missing.yaml")])


def test_cli_arguments(registered):
    with pytest.raises(ConfigError, match="unknown experiment 'toy-sfx'.*toy-sft"):
        parse_cli(["toy-sfx"])
    with pytest.raises(ConfigError, match="no experiment"):
        parse_cli([])
    with pytest.raises(ConfigError, match="unknown option '--foo'"):
        parse_cli(["toy-sft", "--foo"])
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_cli(["toy-sft", "seed"])
    with pytest.raises(ConfigError, match="needs a YAML file"):
        parse_cli(["toy-sft", "--config"])


def test_help(registered):
    with pytest.raises(HelpRequested) as ei:
        parse_cli(["toy-sft", "--help"])
    text = ei.value.text
    assert "toy-sft" in text and "toy-gen" in text
    assert "model.optimizer.lr: float = 1e-05" in text and "peak learning rate" in text
    assert "toy_factor: float = 0.5" in text and "a toy factor in [0, 1]" in text
    assert "dataset.train_bs_n_seqs: int = 16" in text
    assert "experiment_name: str = 'toy-sft'" in text
    assert "exp_ctrl.save_freq_steps: int | None = null" in text
    with pytest.raises(HelpRequested) as ei:
        parse_cli(["--help"])
    assert "toy-sft" in ei.value.text and "allocation_mode: str" in ei.value.text
    with pytest.raises(HelpRequested) as ei:
        parse_cli(["toy-gen", "-h"])
    assert "gen.temperature: float = 1.0" in ei.value.text


def test_main(paths, registered, capsys):
    def run(name, cfg):  # what the quickstart does with a parsed command line
        registered.append(cfg)
        return 3 if name == "toy-gen" else 0

    main = lambda argv: entry.main(argv, run)  # noqa: E731
    assert main(["toy-sft"] + _base_args(paths) + ["seed=3"]) == 0
    assert registered[-1].seed == 3
    assert main(["toy-sft"] + _base_args(paths) + ["model.optimizer.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.optimizer.lr" in err and "Traceback" not in err
    assert main(["toy-sft", "--help"]) == 0
    assert "model.optimizer.lr" in capsys.readouterr().out
    gen_args = [f"model.path={paths[0]}", f"dataset.path={paths[1]}", "gen.top_p=0"]
    assert main(["toy-gen"] + gen_args) == 2
    assert "gen.top_p" in capsys.readouterr().err
    assert main(["toy-gen"] + gen_args[:2]) == 3


def test_load_config_programmatic(paths):
    cfg = load_config(qc.GenerationExpConfig, overrides=[f"model.path={paths[0]}", f"dataset.path={paths[1]}",
                                                         "gen.greedy=true", "gen.stop_token_ids=[2,3]"])
    assert cfg.gen.to_hyperparameters().stop_token_ids == (2, 3) and cfg.gen.greedy
    assert cfg.experiment_name == "quickstart"


def test_renamed_options_load_under_their_old_names(paths, tmp_path):
    """The reward options moved into the ``reward`` section: their old top-level names, in a YAML file or an
    override, set the new options, and the loader names every old name it met in one warning."""
    import logging

    base = [f"actor.path={paths[0]}", f"dataset.path={paths[1]}"]
    old = tmp_path / "old.yaml"
    old.write_text("correct_reward: 3.0\nreward_allow_last_number: true\n")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("realhf.api.quickstart.entry")
    log.addHandler(handler)
    try:
        cfg = load_config(qc.PPOMathConfig, [str(old)], base + ["reward_timeout_secs=2.0", "wrong_reward=-1.0",
                                                                  "reward_unfinished_as_wrong=true"])
    finally:
        log.removeHandler(handler)
    new = load_config(qc.PPOMathConfig, [], base + ["reward.correct_reward=3.0", "reward.allow_last_number=true",
                                                    "reward.timeout_secs=2.0", "reward.wrong_reward=-1.0",
                                                    "reward.unfinished_as_wrong=true"])
    assert cfg.reward == new.reward and new.reward.grader_args() == dict(
        correct_reward=3.0, wrong_reward=-1.0, timeout_secs=2.0, allow_last_number=True, unfinished_as_wrong=True)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and all(f"{k} -> reward." in warned[0] for k in (
        "correct_reward", "reward_allow_last_number", "reward_timeout_secs", "wrong_reward",
        "reward_unfinished_as_wrong")), warned
    both = tmp_path / "both.yaml"
    both.write_text("correct_reward: 3.0\nreward: {correct_reward: 4.0}\n")
    with pytest.raises(ConfigError, match=r"both 'reward\.correct_reward' and its deprecated old name 'correct_reward'"):
        load_config(qc.PPOMathConfig, [str(both)], base)


def test_registry(registered):
    exps = entry.registered_experiments()
    assert exps["toy-sft"].config_cls.__name__ == "ToyConfig"
    entry.register_quickstart_exp("toy-sft", exps["toy-sft"].config_cls, exps["toy-sft"].build_fn)  # idempotent
    with pytest.raises(ValueError, match="already registered"):
        entry.register_quickstart_exp("toy-sft", qc.SFTConfig, lambda c: 0)
    with pytest.raises(ValueError, match="dataclass"):
        entry.register_quickstart_exp("toy-x", int, lambda c: 0)
    # the experiments of realhf.experiments are in the same registry, with the builder of their spec
    from realhf.experiments import build_spec, registered

    assert {"sft", "gen", "ppo-math"} <= set(registered()) and "toy-sft" not in registered()  # no builder
    assert entry.registered_experiments()["ppo-math"].config_cls is qc.PPOMathConfig
    with pytest.raises(KeyError, match="unknown experiment 'toy-sft'"):
        build_spec("toy-sft", None)


def test_ppo_checks(paths):
    base = dict(actor=qc.ModelTrainEvalConfig(path=paths[0]), dataset=qc.PromptOnlyDatasetConfig(path=paths[1], train_bs_n_seqs=2))
    with pytest.raises(ValueError, match="ppo.group_adv_norm"):
        qc.PPOMathConfig(**base, ppo=qc.PPOHyperparameters(group_adv_norm=True))
    # 2 prompts * group 1 over dp 2 leaves one sequence per rank, fewer than 4 minibatches
    with pytest.raises(ValueError, match="_train.*must be >= 8"):
        qc.PPOMathConfig(**base, n_devices_per_node=2, allocation_mode="d2")
    qc.PPOMathConfig(**base, n_devices_per_node=2, allocation_mode="d2", group_size=4)
    with pytest.raises(ValueError, match="c_clip"):
        qc.PPOHyperparameters(c_clip=0.5)


@pytest.mark.parametrize("key,value", [(k, v) for k in ("model.optimizer.lr", "model.optimizer.gradient_clipping",
                                                          "worker_timeout_secs", "toy_factor")
                                       for v in ("inf", "nan", "-inf")] + [("auto_eval.temperature", "inf")])
def test_nonfinite_options_are_rejected(paths, registered, key, value):
    with pytest.raises(ConfigError) as ei:
        parse_cli(["toy-sft"] + _base_args(paths) + [f"{key}={value}"])
    msg = str(ei.value)
    assert key in msg and f"={value}" in msg and "finite" in msg, msg


def test_nonfinite_ppo_options_are_rejected(paths):
    base = [f"actor.path={paths[0]}", f"dataset.path={paths[1]}"]
    for item, key in (("ppo.eps_clip=inf", "ppo.eps_clip"), ("ppo.kl_ctl=nan", "ppo.kl_ctl"),
                      ("ppo.gen.temperature=inf", "ppo.gen.temperature"), ("correct_reward=-inf", "correct_reward"),
                      ("critic.optimizer.lr=inf", "critic.optimizer.lr")):
        with pytest.raises(ConfigError) as ei:
            load_config(qc.PPOMathConfig, overrides=base + [item])
        assert key in str(ei.value) and "finite" in str(ei.value), str(ei.value)


def test_nonfinite_yaml_value_is_rejected(paths, registered, tmp_path):
    y = tmp_path / "a.yaml"
    y.write_text("model:\n  optimizer:\n    lr: .inf\n")
    with pytest.raises(ConfigError, match=r"model\.optimizer\.lr=inf.*finite"):
        parse_cli(["toy-sft", "--config", str(y)] + _base_args(paths))


def test_a_float_option_added_later_is_covered(paths):
    """No per-field check needed: every float option of an experiment must be finite."""

    @dataclasses.dataclass
    class WithNewOption(qc.SFTConfig):
        new_coef: float = dataclasses.field(default=0.5, metadata={"help": "an option with no check of its own"})
        new_list: List[float] = dataclasses.field(default_factory=lambda: [1.0], metadata={"help": "floats"})

    base = [f"model.path={paths[0]}", f"dataset.train_path={paths[1]}"]
    assert load_config(WithNewOption, overrides=base + ["new_coef=1e30"]).new_coef == 1e30
    with pytest.raises(ConfigError, match=r"new_coef=inf.*finite"):
        load_config(WithNewOption, overrides=base + ["new_coef=inf"])
    with pytest.raises(ConfigError, match=r"new_list\[1\]=nan.*finite"):
        load_config(WithNewOption, overrides=base + ["new_list=[1.0,nan]"])


def test_optimizer_config_checks():
    from realhf.api.core.config import OptimizerConfig

    for kw in (dict(lr=float("inf")), dict(lr=float("nan")), dict(beta1=float("nan")), dict(eps=float("inf"))):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.*finite"):
            OptimizerConfig(**kw)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="skip_nonfinite_steps"):
            OptimizerConfig(skip_nonfinite_steps=bad)
    assert OptimizerConfig(skip_nonfinite_steps=3).skip_nonfinite_steps == 3
