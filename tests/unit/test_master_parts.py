"""The master's parts without processes: the sample buffer, the DFG executor and the save/checkpoint cadence."""
import threading

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MFCDef, build_graph
from realhf.api.core.system_api import DatasetSpec, ExperimentSpec, ModelSpec
from realhf.base.topology import ParallelDims
from realhf.system.trainer.buffer import SampleBuffer
from realhf.system.trainer.cadence import Cadence
from realhf.system.trainer.executor import DFGExecutor, StuckGraph


def header(ids, keys, length=3):
    n = len(ids)
    s = SequenceSample(keys=set(keys), ids=list(ids), seqlens={k: [[length]] * n for k in keys},
                       trailing_shapes={k: () for k in keys}, dtypes={k: torch.float32 for k in keys},
                       data={k: torch.zeros(n * length) for k in keys}, metadata={"query_id": [f"q{i}" for i in ids]})
    return s.meta().to_wire()[0]


def ppo_graph():
    mk = lambda name, model, kind, ins, outs: MFCDef(name, model, kind, "x", input_keys=ins, output_keys=outs)
    mfcs = [mk("actor_gen", "actor", "generate", ("packed_prompts",), ("packed_input_ids", "prompt_mask")),
            mk("rew_inf", "reward", "inference", ("packed_input_ids", "prompt_mask"), ("rewards",)),
            mk("ref_inf", "ref", "inference", ("packed_input_ids",), ("ref_logprobs",)),
            mk("actor_train", "actor", "train_step", ("packed_input_ids", "prompt_mask", "rewards", "ref_logprobs"), ())]
    return build_graph(mfcs, {"packed_prompts"})


def test_buffer_records_owners_metadata_and_birth():
    b = SampleBuffer()
    assert b.add(header(["a", "b"], ["packed_prompts"]), owner=0, step=7) == ["a", "b"]
    b.add(header(["a", "b"], ["packed_input_ids"], length=5), owner=1, step=8, version=3)
    assert b.owners["a"] == {"packed_prompts": 0, "packed_input_ids": 1}
    assert b.metas["a"]["packed_input_ids"]["seqlens"] == [5] and b.metadata["b"] == {"query_id": "qb"}
    assert b.tokens["a"] == 5  # the cost follows the longest-known sequence
    birth = b.birth("a")
    assert birth.step == 7 and birth.versions == {"packed_prompts": None, "packed_input_ids": 3}
    assert b.has(["a", "b"], ["packed_prompts", "packed_input_ids"]) and not b.has(["a"], ["rewards"])
    assert b.missing(["a", "b"], ["rewards", "packed_prompts"]) == ["rewards"]
    b.add(header(["c"], ["packed_prompts"]), owner=0, step=9)  # the buffer outlives a step
    b.drop(["a", "b"])
    assert b.ids() == ["c"] and len(b) == 1 and b.birth("c").step == 9


def _runner(buffer, log, gate=None, fail=None, silent=()):
    """A run_mfc that records start/end, waits at ``gate`` if given, raises in ``fail``, and adds its outputs (except
    for MFCs in ``silent``)."""

    def run(mfc, ids):
        log.append(("start", mfc.name, buffer.has(ids, mfc.buffer_input_keys)))
        if gate is not None and mfc.name in gate[0]:
            gate[1].wait(timeout=30)  # both independent MFCs must be running at once to pass
        if mfc.name == fail:
            raise ValueError(f"{mfc.name} broke")
        if mfc.output_keys and mfc.name not in silent:
            buffer.add(header(ids, mfc.buffer_output_keys), owner=0, step=1, version=0)
        log.append(("end", mfc.name))
        return {"n": len(ids)}

    return run


def test_executor_runs_each_mfc_once_when_its_inputs_are_ready():
    graph, buffer, log = ppo_graph(), SampleBuffer(), []
    ids = buffer.add(header(["s0", "s1"], ["packed_prompts"]), owner=0, step=1)
    barrier = threading.Barrier(2)
    out = DFGExecutor(graph, buffer, _runner(buffer, log, gate=({"rew_inf", "ref_inf"}, barrier))).run(ids)
    assert sorted(out) == ["actor_gen", "actor_train", "ref_inf", "rew_inf"] and out["actor_train"] == {"n": 2}
    starts = [e for e in log if e[0] == "start"]
    assert len(starts) == 4 and all(ready for _, _, ready in starts), "an MFC started before its inputs were there"
    pos = {(e[0], e[1]): i for i, e in enumerate(log)}
    assert pos[("end", "actor_gen")] < pos[("start", "rew_inf")] and pos[("end", "actor_gen")] < pos[("start", "ref_inf")]
    assert pos[("start", "actor_train")] > max(pos[("end", "rew_inf")], pos[("end", "ref_inf")])
    assert not barrier.broken, "rew_inf and ref_inf are independent and must run at the same time"


def test_executor_stops_starting_mfcs_after_a_failure():
    graph, buffer, log = ppo_graph(), SampleBuffer(), []
    ids = buffer.add(header(["s0"], ["packed_prompts"]), owner=0, step=1)
    with pytest.raises(ValueError, match="rew_inf broke"):
        DFGExecutor(graph, buffer, _runner(buffer, log, fail="rew_inf")).run(ids)
    started = {e[1] for e in log if e[0] == "start"}
    assert "actor_train" not in started and {"actor_gen", "rew_inf"} <= started


def test_executor_names_what_a_stuck_graph_waits_for():
    graph, buffer, log = ppo_graph(), SampleBuffer(), []
    ids = buffer.add(header(["s0"], ["packed_prompts"]), owner=0, step=1)
    with pytest.raises(StuckGraph, match=r"actor_train waits for \['ref_logprobs'\]"):
        DFGExecutor(graph, buffer, _runner(buffer, log, silent={"ref_inf"})).run(ids)


def _spec(**freq):
    m = ModelSpec("default", "", ParallelDims(1, 1, 1), [0])
    return ExperimentSpec(experiment_name="e", trial_name="t", n_workers=1, models=[m], mfcs=[],
                          dataset=DatasetSpec("prompt", {}, 1, "default"), total_train_epochs=1, seed=1,
                          log_dir="/tmp/l", save_dir="/tmp/s", recover_dir="/tmp/r", **freq)


def test_cadence():
    now = [0.0]
    c = Cadence(_spec(save_freq_steps=3, ckpt_freq_epochs=2, ckpt_freq_secs=100, eval_freq_steps=2), clock=lambda: now[0])
    assert [c.evaluate(s, 0, False) for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert c.save_and_ckpt(1, 0, False, last=False) == (False, False)
    assert c.save_and_ckpt(3, 0, True, last=False) == (True, False)  # epoch 1 ended: not a multiple of 2
    assert c.save_and_ckpt(4, 1, True, last=False) == (False, True)  # epoch 2 ended
    now[0] = 150.0
    assert c.save_and_ckpt(5, 2, False, last=False) == (False, True)  # 100 s since the last checkpoint
    assert c.save_and_ckpt(7, 2, False, last=True) == (True, False)  # the last step saves, never checkpoints
    quiet = Cadence(_spec())
    assert quiet.save_and_ckpt(5, 0, True, last=True) == (False, False) and not quiet.evaluate(5, 0, True)


def test_hooks_reallocate_stale_mirrors_and_offload_after_their_mfc():
    from realhf.api.core.config import OptimizerConfig
    from realhf.system.trainer.hooks import OffloadHook, ParamReallocHook, ParamVersionHook

    P = ParallelDims.parse
    models = [ModelSpec("actor", "", P("d1m2p1"), [0, 1], optimizer=OptimizerConfig()),
              ModelSpec("actor@1", "", P("d2m1p1"), [1, 2], realloc_from="actor", offload=True)]
    spec = ExperimentSpec(experiment_name="e", trial_name="t", n_workers=3, models=models, mfcs=[],
                          dataset=DatasetSpec("prompt", {}, 2, "actor"), total_train_epochs=1, seed=1, log_dir="/tmp/l",
                          save_dir="/tmp/s", recover_dir="/tmp/r")
    calls = []
    call = lambda name, by_rank: calls.append((name, by_rank)) or {}
    versions = ParamVersionHook(spec, resumed=False)
    hooks = [ParamReallocHook(spec, call, versions), versions, OffloadHook(spec, call)]
    gen = MFCDef("actor_gen", "actor@1", "generate", "x", input_keys=("p",), output_keys=("ids",))
    train = MFCDef("actor_train", "actor", "train_step", "x", input_keys=("ids",))

    def run(mfc):
        stats = {}
        for h in hooks:
            stats.update(h.before(mfc))
        for h in hooks:
            h.after(mfc, stats)
        return stats

    assert "realloc_time" not in run(gen)  # both at version 0: nothing to move
    assert calls == [("offload", {1: {"models": ["actor@1"]}, 2: {"models": ["actor@1"]}})]
    calls.clear()
    run(train)
    assert calls == [] and versions.version("actor") == 1  # the trained replica is never offloaded
    assert "realloc_time" in run(gen)
    assert [c[0] for c in calls] == ["realloc", "offload"]
    assert sorted(calls[0][1]) == [0, 1, 2] and calls[0][1][0] == {"src": "actor", "dst": "actor@1"}
    assert versions.version("actor@1") == 1
