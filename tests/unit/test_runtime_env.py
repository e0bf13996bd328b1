"""The runtime environment: its choices, and that the worker's code paths take device and backend from it.

* ``select`` decides from explicit facts, so the CUDA branch (NCCL, ``cuda:<local rank>``, bf16, flash-attn
  when importable) is checked here without a GPU.
* An audit runs a model worker's code paths (loading three models through ``ModelWorker``, pipeline
  training, inference, sequential and pipelined generation, tensor-parallel generation, reallocation and
  offload through the worker's handler, data-manager transfers) on 2 processes under an environment whose
  device is ``torch.device("cpu", 0)``, a CPU device that no code names by accident: every tensor factory
  called from realhf code must pass a device, and that device must be the environment's (or one read from
  an existing tensor); no realhf code may construct a device from a string; every process group must use
  the environment's backend. A short allow-list names the places that are on the host by nature.
"""
import functools
import io
import os
import sys
import tokenize

import pytest
import torch
from torch.overrides import TorchFunctionMode

from realhf.base.device_slots import check_slot_gpus
from realhf.base.process import source_root
from realhf.base.runtime_env import (
    CPU_BACKEND,
    GPU_BACKEND,
    RuntimeEnv,
    cpu_env,
    detect,
    gpu_of_slot,
    local_rank,
    select,
)
from realhf.testing import run_distributed

REPO = source_root()
REALHF = os.path.join(REPO, "realhf") + os.sep
TORCH_NN = os.sep + os.path.join("torch", "nn") + os.sep


# ------------------------------------------------------------------------------------------ selection
def test_cuda_present_selects_nccl_local_device_bf16_and_flash():
    env = select(cuda_available=True, device_count=4, local_rank=2, flash_attn_available=True)
    assert env.device == torch.device("cuda", 2)
    assert env.backend == GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert env.dtype == torch.bfloat16 and env.attention == "flash" and env.is_cuda
    no_flash = select(cuda_available=True, device_count=4, local_rank=3, flash_attn_available=False)
    assert no_flash.attention == "sdpa" and no_flash.device == torch.device("cuda", 3)


def test_no_cuda_selects_gloo_cpu_fp32_sdpa():
    for facts in ({"cuda_available": False, "device_count": 0}, {"cuda_available": True, "device_count": 0}):
        env = select(local_rank=5, flash_attn_available=True, **facts)
        assert (env.device, env.backend, env.dtype, env.attention) == (torch.device("cpu"), CPU_BACKEND,
                                                                      torch.float32, "sdpa")
    if not torch.cuda.is_available():
        assert detect(local_rank=1) == select(cuda_available=False, device_count=0, local_rank=1)


def test_overrides_and_refusals():
    env = select(cuda_available=True, device_count=2, device="cpu", dtype="float32")
    assert env.device.type == "cpu" and env.backend == CPU_BACKEND and env.attention == "sdpa"
    assert select(cuda_available=False, device_count=0, device="cpu:0").device == torch.device("cpu", 0)
    with pytest.raises(ValueError, match="local rank 2 has no GPU: 2 CUDA device"):
        select(cuda_available=True, device_count=2, local_rank=2)
    with pytest.raises(ValueError, match="no CUDA device is available"):
        select(cuda_available=False, device_count=0, device="cuda:0")
    with pytest.raises(ValueError, match="attention='flash' needs a CUDA device and the flash_attn package"):
        select(cuda_available=True, device_count=1, attention="flash", flash_attn_available=False)
    with pytest.raises(ValueError, match="allowed: \\['bfloat16', 'float16', 'float32'\\]"):
        select(cuda_available=False, device_count=0, dtype="fp8")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        RuntimeEnv(torch.device("cpu"), "gloo", torch.float32, "flash")


def test_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank(5, 4) == 1 and local_rank(5, 4, own_devices=True) == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank(5, 4) == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        local_rank(0, 1)


def test_slots_sharing_gpus(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    # one GPU per slot: a node's slots in order; gpus_per_node=2 of 4 slots: slot s on GPU s % 2 (node 1 likewise)
    assert [gpu_of_slot(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [gpu_of_slot(s, 4, 2) for s in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert local_rank(3, 4, gpus_per_node=2) == 1 and local_rank(3, 4, own_devices=True, gpus_per_node=2) == 0
    check_slot_gpus(2, 2, 1, device_count=1)  # two slots on the one GPU
    check_slot_gpus(2, 2, 0, device_count=0)  # no CUDA device: nothing to place
    with pytest.raises(ValueError, match=r"use 2 GPU\(s\) on this node, but 1 CUDA device\(s\) .* gpus_per_node=1"):
        check_slot_gpus(2, 2, 0, device_count=1)
    with pytest.raises(ValueError, match=r"gpus_per_node=2\) use 2 GPU\(s\).*but 1 CUDA.*lower gpus_per_node to 1"):
        check_slot_gpus(4, 4, 2, device_count=1)


def test_cpu_memory_stats_see_an_allocation():
    env = cpu_env()
    env.reset_peak_memory()
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    peak = env.memory_stats()["peak_mem_gib"]
    assert peak * 2**30 >= x.numel(), peak
    del x


def test_the_threaded_modules_name_no_device_or_backend():
    """No string literal 'cpu', 'gloo', 'nccl' or 'cuda...' in the modules that take them from the environment."""
    files = ["realhf/base/topology.py", "realhf/testing.py", "realhf/system/trainer/model_worker.py",
             "realhf/system/trainer/data_manager.py", "realhf/apps/remote.py", "realhf/impl/model/conversion/hf_io.py"]
    for sub in ("backend", "nn", "parallelism"):
        d = os.path.join(REPO, "realhf/impl/model", sub)
        files += [os.path.join("realhf/impl/model", sub, f) for f in sorted(os.listdir(d)) if f.endswith(".py")]
    found = []
    for f in files:
        with open(os.path.join(REPO, f)) as fh:
            for tok in tokenize.generate_tokens(io.StringIO(fh.read()).readline):
                if tok.type == tokenize.STRING and not tok.string.startswith(('"""', "'''")):
                    v = tok.string.strip("rbfRBF").strip("\"'")
                    if v in ("cpu", "gloo", "nccl") or v.startswith(("cpu:", "cuda")):
                        found.append(f"{f}:{tok.start[0]}: {tok.string}")
    assert not found, "hard-coded device or backend:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------ the audit
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided}

# Host memory by nature: (file, function) -> why.
ON_HOST = {
    ("real_model.py", "ReaLModel.init_random"): "layout- and device-independent init from host generators",
    ("attention.py", "rotary_inv_freq"): "rotary tables computed on the host like HF's, then moved",
    ("sampling.py", "RowStreams.uniforms"): "per-sequence host generators: the same samples on any device",
    ("engine.py", "InferenceEngine.offload"): "the offloaded copy is host memory by definition",
    ("cpu_gemm.py", "probe"): "times the CPU GEMM kernels: host tensors by definition",
    ("cpu_gemm.py", "onednn_serves"): "asks oneDNN, a CPU library, whether it runs a dtype: host tensors by definition",
}


class DeviceAudit(TorchFunctionMode):
    """Records every tensor allocation and device choice made from realhf code that does not go through
    ``device`` (the environment's): a factory without a device, a device given as a string, a device built
    from a string, ``.cpu()``; devices read from existing tensors (type cpu, no index here) pass."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.violations = []
        self.n_checked = 0

    @staticmethod
    def _caller():
        f = sys._getframe(2)
        while f is not None and TORCH_NN in f.f_code.co_filename:
            f = f.f_back  # through torch.nn constructors (nn.Linear(device=...)) to the code that asked
        if f is None or not f.f_code.co_filename.startswith(REALHF):
            return None  # torch's own internals (e.g. a collective's staging buffers) are not audited
        code = f.f_code
        qualname = getattr(code, "co_qualname", code.co_name).split(".<locals>")[0]
        return os.path.basename(code.co_filename), qualname, f.f_lineno

    def _flag(self, where, what):
        if (where[0], where[1]) not in ON_HOST:
            self.violations.append(f"{where[0]}:{where[2]} ({where[1]}): {what}")

    def _check_device(self, where, dev, what):
        if isinstance(dev, str) and dev != "meta":
            self._flag(where, f"{what} with device given as the string {dev!r}")
        elif isinstance(dev, torch.device) and dev != self.device and dev != torch.device("cpu") and dev.type != "meta":
            self._flag(where, f"{what} on {dev}, not the environment's {self.device}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = None
        if func in FACTORIES or func is torch.device or func in (torch.Tensor.to, torch.Tensor.cpu):
            where = self._caller()
        if where is not None and where[0] != "runtime_env.py":
            self.n_checked += 1
            name = getattr(func, "__name__", str(func))
            if func is torch.device:
                if args and isinstance(args[0], str) and args[0] != "meta":
                    self._flag(where, f"torch.device({args[0]!r}) built from a string")
            elif func is torch.Tensor.cpu:
                self._flag(where, ".cpu()")
            elif func is torch.Tensor.to:
                for a in list(args[1:]) + [kwargs.get("device")]:
                    self._check_device(where, a, ".to()")
            elif kwargs.get("device") is None:
                self._flag(where, f"torch.{name} without a device")
            else:
                self._check_device(where, kwargs["device"], f"torch.{name}")
        return func(*args, **kwargs)


def _spec(path):
    from realhf.api.core.config import OptimizerConfig
    from realhf.api.core.system_api import DatasetSpec, ExperimentSpec, ModelSpec
    from realhf.base.topology import ParallelDims

    P = ParallelDims.parse
    models = [ModelSpec("actor", path, P("d1m1p2"), [0, 1], optimizer=OptimizerConfig(lr=1e-3), total_train_steps=2),
              ModelSpec("actor@1", path, P("d2m1p1"), [0, 1], realloc_from="actor", offload=True),
              ModelSpec("ref", path, P("d1m2p1"), [0, 1])]
    return ExperimentSpec("audit", "t", 2, models, [], DatasetSpec("none", {}, 2, "actor"), 1, 0, "", "", "")


def _audited_worker(path, runtime_env):
    import torch.distributed as dist
    import torch.nn.functional as F

    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.system.trainer.data_manager import DataManager
    from realhf.system.trainer.model_worker import ModelWorker

    env, rank = runtime_env, dist.get_rank()
    backends = [dist.get_backend()]
    new_group = dist.new_group

    def recording_new_group(*a, **kw):
        backends.append(kw.get("backend"))
        return new_group(*a, **kw)

    dist.new_group = recording_new_group
    audit = DeviceAudit(env.device)
    lens = [5, 3, 7, 4]
    g = torch.Generator().manual_seed(0)
    try:
        with audit:
            w = ModelWorker(_spec(path), rank, b"", None, resume=False, env=env)
            w._build_models()
            actor, ref = w.models["actor"], w.models["ref"]
            vocab = actor.module.config.vocab_size
            batch = SequenceSample.from_default(ids=list(range(4)), seqlens=lens,
                                                data={"packed_input_ids": torch.randint(3, vocab, (sum(lens),), generator=g)})

            def loss_fn(logits, mb):
                ids = mb.data["packed_input_ids"]
                lp = F.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None])
                return -lp.mean(), {}

            actor.engine.train_batch(batch, loss_fn, lambda mb: 1.0, n_mbs=2)
            actor.engine.forward(batch)  # pipelined inference
            g0 = GenerationHyperparameters(max_new_tokens=4, greedy=True)
            prompts = [[5, 6, 7], [8, 9]]
            actor.engine.generate(prompts, g0)  # pipelined schedule
            from realhf.impl.model.nn.generation import generate

            generate(actor.module, prompts, g0, pipeline_groups=1)  # sequential schedule over 2 stages
            ref.engine.generate(prompts, GenerationHyperparameters(max_new_tokens=4, temperature=0.7), seeds=[1, 2])
            w._h_realloc({"src": "actor", "dst": "actor@1"})  # loads the mirror and moves the parameters
            w._h_offload({"models": ["actor@1"]})  # what the master's OffloadHook asks after the mirror's MFC
            w._load_params("actor@1")
            w.models["actor@1"].engine.forward(batch.split(2)[rank])
            dm = DataManager(rank, env.device)
            if rank == 0:
                dm.put(batch)
            metas = {str(i): {"packed_input_ids": {"seqlens": [n], "trailing_shape": [], "dtype": "int64"}}
                     for i, n in enumerate(lens)}
            dm.execute([(0, 1, str(i), "packed_input_ids") for i in range(4)], metas)
            assert dm.get([str(i) for i in range(4)], ["packed_input_ids"]).data["packed_input_ids"].tolist() \
                == batch.data["packed_input_ids"].tolist()
    finally:
        dist.new_group = new_group
    return {"violations": audit.violations, "n_checked": audit.n_checked, "backends": backends,
            "param_device": str(actor.module.flat.device)}


AUDIT_ENV = functools.partial(select, cuda_available=False, device_count=0, device="cpu:0")


def test_worker_paths_take_device_and_backend_from_the_environment():
    from realhf.impl.model.tiny import ensure_tiny_model

    path = ensure_tiny_model("qwen2")
    out = run_distributed(_audited_worker, 2, path, runtime_env=AUDIT_ENV, timeout=240)
    env = AUDIT_ENV(local_rank=0)
    for rank, r in enumerate(out):
        assert r["n_checked"] > 100, r["n_checked"]
        assert not r["violations"], f"rank {rank}: allocations not through the environment:\n" + "\n".join(
            sorted(set(r["violations"])))
        assert set(r["backends"]) == {env.backend}, r["backends"]
        assert len(r["backends"]) > 5


def test_worker_joins_its_world_with_the_environments_backend(tmp_path, monkeypatch):
    import types

    import torch.distributed as dist

    from realhf.base import name_resolve
    from realhf.system.trainer import model_worker

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    spec = types.SimpleNamespace(experiment_name="audit", trial_name="t", n_workers=1)
    nr = name_resolve.make_repository("file", root=str(tmp_path))
    sock = model_worker._init_distributed(spec, 0, nr, "some-backend")
    sock.close()
    assert seen["backend"] == "some-backend" and seen["world_size"] == 1


def test_the_launcher_checks_devices_without_torch():
    """The launcher makes the run secret and checks the device slots before any worker starts, without importing
    torch (1.1-1.5 s a launch on the 2-core machines); a CPU machine's check needs no torch at all."""
    import subprocess

    code = ("import sys; import realhf.apps.main, realhf.scheduler.local as l; "
            "from types import SimpleNamespace as C; "
            "l._check_devices(C(n_devices_per_node=2, gpus_per_node=0), 2); "
            "from realhf.base.run_secret import new_run_secret; assert len(new_run_secret()) == 32; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    on_gpu_machine = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg"))
    assert out.stdout.strip() == str(on_gpu_machine)
