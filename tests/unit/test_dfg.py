import dataclasses

import pytest

from realhf.api.core.dfg import (
    MFCDef,
    MicroBatchSpec,
    ModelInterfaceType,
    ModelName,
    build_graph,
)

GEN, INF, TRAIN = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP


def ppo_mfcs():
    return [
        MFCDef(
            name="actor_gen", model_name="actor", interface_type=GEN, interface_impl="ppo_actor",
            input_keys=("packed_prompts",),
            output_keys=("packed_input_ids", "packed_logprobs", "prompt_mask", "seq_no_eos_mask"),
        ),
        MFCDef(
            name="rew_inf", model_name="reward", interface_type=INF, interface_impl="rw_math",
            input_keys=("packed_input_ids",), output_keys=("scores",),
            output_key_remap={"scores": "rewards"},
        ),
        MFCDef(
            name="ref_inf", model_name="ref", interface_type=INF, interface_impl="ppo_actor",
            input_keys=("packed_input_ids",), output_keys=("logprobs",),
            output_key_remap={"logprobs": "packed_ref_logprobs"},
            mb_spec=MicroBatchSpec(n_mbs=2, max_tokens_per_mb=4096),
        ),
        MFCDef(
            name="critic_inf", model_name="critic", interface_type=INF, interface_impl="ppo_critic",
            input_keys=("packed_input_ids", "seq_no_eos_mask"), output_keys=("values",),
        ),
        MFCDef(
            name="actor_train", model_name="actor", interface_type=TRAIN, interface_impl="ppo_actor",
            input_keys=("packed_input_ids", "packed_logprobs", "packed_ref_logprobs", "rewards",
                        "values", "prompt_mask", "seq_no_eos_mask"),
        ),
        MFCDef(
            name="critic_train", model_name="critic", interface_type=TRAIN, interface_impl="ppo_critic",
            input_keys=("packed_input_ids", "packed_logprobs", "packed_ref_logprobs", "rewards",
                        "values", "prompt_mask", "seq_no_eos_mask"),
        ),
    ]


def test_model_name():
    assert str(ModelName("actor")) == "actor" and str(ModelName("actor", 1)) == "actor@1"
    assert ModelName.parse("actor@1") == ModelName("actor", 1)
    assert ModelName.parse("actor@0") == ModelName.parse("actor") == ModelName("actor", 0)
    assert ModelName.parse(str(ModelName("critic", 3))) == ModelName("critic", 3)
    assert hash(ModelName("a")) == hash(ModelName.parse("a"))
    for bad in ("", "actor@x", "a@b@1", "actor@-1"):
        with pytest.raises(ValueError):
            ModelName.parse(bad)
    with pytest.raises(ValueError):
        ModelName("actor", -1)


def test_mb_spec_and_mfc_validation():
    with pytest.raises(ValueError, match="n_mbs"):
        MicroBatchSpec(n_mbs=0)
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        MicroBatchSpec(max_tokens_per_mb=-5)
    m = ppo_mfcs()[0]
    assert m.model_name == ModelName("actor") and m.is_generate and not m.is_train
    assert MFCDef("t", "actor@1", "train_step", "ppo_actor").is_train
    with pytest.raises(ValueError, match="interface_type 'fly'"):
        MFCDef("x", "actor", "fly", "impl")
    with pytest.raises(ValueError, match="not the str"):
        MFCDef("x", "actor", GEN, "impl", input_keys="packed_prompts")
    with pytest.raises(ValueError, match="not in output_keys"):
        MFCDef("x", "actor", GEN, "impl", output_keys=("a",), output_key_remap={"b": "c"})
    with pytest.raises(ValueError, match="duplicate buffer names"):
        MFCDef("x", "actor", GEN, "impl", output_keys=("a", "b"), output_key_remap={"a": "b"})


def test_key_remap_helpers():
    m = MFCDef(
        "rew", "reward", INF, "rw", input_keys=("packed_seq",), input_key_remap={"packed_seq": "packed_input_ids"},
        output_keys=("scores",), output_key_remap={"scores": "rewards"},
    )
    assert m.buffer_input_keys == ("packed_input_ids",) and m.buffer_output_keys == ("rewards",)
    assert m.input_buffer_to_interface() == {"packed_input_ids": "packed_seq"}
    assert m.output_interface_to_buffer() == {"scores": "rewards"}


def test_ppo_graph():
    g = build_graph(ppo_mfcs(), dataset_keys={"packed_prompts", "task_ids"})
    order = g.topological_order()
    assert order == ["actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"]
    pos = {n: i for i, n in enumerate(order)}
    for p, c, keys in g.edges():
        assert pos[p] < pos[c] and keys
    assert g.parents("actor_gen") == [] and g.sources == ["actor_gen"]
    assert g.children("actor_gen") == ["rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"]
    assert g.parents("actor_train") == ["actor_gen", "rew_inf", "ref_inf", "critic_inf"]
    assert g.parents("critic_inf") == ["actor_gen"]
    assert g.edge_keys("actor_gen", "critic_inf") == ("packed_input_ids", "seq_no_eos_mask")
    assert g.edge_keys("ref_inf", "actor_train") == ("packed_ref_logprobs",)
    assert g.sinks == ["actor_train", "critic_train"]
    assert g.producer_of("rewards") == "rew_inf"
    assert g.producer_of("packed_prompts") is None
    with pytest.raises(KeyError, match="nope"):
        g.producer_of("nope")
    assert g.dataset_keys_of("actor_gen") == {"packed_prompts"}
    assert g.dataset_keys_of("actor_train") == set()
    assert g.used_dataset_keys == {"packed_prompts"}
    for a, b in [("rew_inf", "ref_inf"), ("rew_inf", "critic_inf"), ("ref_inf", "critic_inf"),
                 ("actor_train", "critic_train")]:
        assert g.independent(a, b) and g.independent(b, a)
    assert not g.independent("actor_gen", "actor_train")
    assert not g.independent("rew_inf", "actor_train")
    assert not g.independent("rew_inf", "rew_inf")
    assert g.ancestors("actor_train") == {"actor_gen", "rew_inf", "ref_inf", "critic_inf"}
    assert g.descendants("rew_inf") == {"actor_train", "critic_train"}
    assert g["ref_inf"].mb_spec.n_mbs == 2 and len(g) == 6
    d = g.describe()
    assert "rewards<-rew_inf" in d and "packed_prompts<-dataset" in d and "critic_train" in d


def test_topological_order_independent_of_input_order():
    mfcs = ppo_mfcs()[::-1]
    g = build_graph(mfcs, {"packed_prompts"})
    order = g.topological_order()
    assert order[0] == "actor_gen" and set(order[-2:]) == {"actor_train", "critic_train"}
    for p, c, _ in g.edges():
        assert order.index(p) < order.index(c)


def test_missing_key_error():
    mfcs = ppo_mfcs()
    mfcs[3] = dataclasses.replace(mfcs[3], input_keys=("packed_input_ids", "seq_no_eos_mask", "attention_bias"))
    with pytest.raises(ValueError) as e:
        build_graph(mfcs, {"packed_prompts"})
    msg = str(e.value)
    assert "'attention_bias'" in msg and "critic_inf" in msg and "packed_prompts" in msg and "rewards" in msg
    with pytest.raises(ValueError, match="'packed_prompts' needed by \\['actor_gen'\\]"):
        build_graph(ppo_mfcs(), {"prompts"})


def test_cycle_error():
    mfcs = ppo_mfcs()
    # actor_gen now also needs the rewards, which depend on its own output.
    mfcs[0] = dataclasses.replace(mfcs[0], input_keys=("packed_prompts", "rewards"))
    with pytest.raises(ValueError, match="cycle") as e:
        build_graph(mfcs, {"packed_prompts"})
    assert "actor_gen -> rew_inf -> actor_gen" in str(e.value) or "rew_inf -> actor_gen -> rew_inf" in str(e.value)
    self_loop = MFCDef("loop", "m", INF, "i", input_keys=("a",), output_keys=("a2",), input_key_remap={"a": "a2"})
    with pytest.raises(ValueError, match="loop -> loop"):
        build_graph([self_loop], set())


def test_duplicate_producer_and_names():
    mfcs = ppo_mfcs()
    mfcs[2] = dataclasses.replace(mfcs[2], output_key_remap={"logprobs": "rewards"})
    with pytest.raises(ValueError, match="'rewards' is produced by two MFCs: 'rew_inf' and 'ref_inf'"):
        build_graph(mfcs, {"packed_prompts"})
    mfcs = ppo_mfcs()
    mfcs.append(dataclasses.replace(mfcs[1], output_keys=("other",), output_key_remap={}))
    with pytest.raises(ValueError, match="duplicate MFC names: \\['rew_inf'\\]"):
        build_graph(mfcs, {"packed_prompts"})
    with pytest.raises(ValueError, match="also provided by the dataset"):
        build_graph(ppo_mfcs(), {"packed_prompts", "rewards"})
    with pytest.raises(ValueError, match="at least one MFC"):
        build_graph([], {"x"})


def test_train_only_graph():
    sft = MFCDef("trainDefault", "default", TRAIN, "sft", input_keys=("packed_input_ids", "prompt_mask"))
    g = build_graph([sft], {"packed_input_ids", "prompt_mask"})
    assert g.sources == g.sinks == ["trainDefault"] and g.edges() == []
    assert g.dataset_keys_of(sft) == {"packed_input_ids", "prompt_mask"}
