"""Interface state: MFCs of one model replica share their interface object (so critic inference
denormalises with the statistics critic training updates), and that state survives a recover checkpoint."""
import pytest
import torch

from realhf.impl.model.tiny import ensure_tiny_model


def _spec(tmp_path, *overrides):
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, config_class
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    model = ensure_tiny_model("qwen2")
    math = tmp_path / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="easy"), str(math))
    cfg = load_config(config_class("ppo-math"), [], [f"actor.path={model}", f"dataset.path={math}",
                                                     f"fileroot={tmp_path}", "use_critic=true", "ppo.value_norm=true",
                                                     "ppo.kl_ctl=0.1", *overrides])
    return build_spec("ppo-math", cfg)


def test_mfcs_of_one_replica_share_their_interface(tmp_path):
    from realhf.system.trainer.model_worker import make_interfaces

    ifs = make_interfaces(_spec(tmp_path).mfcs)
    assert ifs["critic_inf"] is ifs["critic_train"]
    assert ifs["actor_gen"] is ifs["actor_train"]
    assert ifs["ref_inf"] is not ifs["actor_train"]
    ifs = make_interfaces(_spec(tmp_path, "allocation_mode=actor_gen:d2m1p1,*:d1m1p1", "n_devices_per_node=2").mfcs)
    assert ifs["actor_gen"] is not ifs["actor_train"]  # two replicas of the actor


def test_value_norm_needs_critic_mfcs_on_one_layout(tmp_path):
    with pytest.raises(ValueError, match="value_norm=true needs critic_inf and critic_train on one layout"):
        _spec(tmp_path, "allocation_mode=critic_inf:d2m1p1,*:d1m1p1", "n_devices_per_node=2")


def test_critic_state_round_trip():
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.impl.model.interface.ppo_interface import PPOCriticInterface

    a = PPOCriticInterface(PPOHyperparameters(value_norm=True))
    assert a.state_dict() == {}
    x = torch.tensor([3.0, 5.0, 9.0, 100.0])
    a._normalizer(None).update(x, torch.tensor([True, True, True, False]))
    st = a.state_dict()
    b = PPOCriticInterface(PPOHyperparameters(value_norm=True))
    b.load_state_dict(st, Model(name="critic", engine=None, tokenizer=None, grid=None, path=""))
    assert b.state_dict() == st and st["value_normalizer"]["mean"] != 0.0
    assert torch.equal(b.value_normalizer.normalize(x), a.value_normalizer.normalize(x))
