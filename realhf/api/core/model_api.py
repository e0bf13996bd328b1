"""Model-level abstractions: the ReaLModel config, the HF-family registry, model interfaces and backends. The
generation options (:class:`GenerationHyperparameters`) are the generation contract's (``realhf.api.core.generation``),
re-exported here."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from realhf.api.core.generation import (  # noqa: F401 (the generation contract's options, re-exported)
    KV_CACHE_DTYPES,
    GenerationHyperparameters,
    check_kv_cache_dtype,
    kv_cache_torch_dtype,
)


@dataclasses.dataclass
class ReaLModelConfig:
    """Architecture of a decoder-only transformer, independent of the HF family it came from."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    intermediate_dim: int
    vocab_size: int
    n_positions: Optional[int] = None  # size of the learned position table (GPT-2 style); None = no table
    max_positions: Optional[int] = None  # positions a rotary model was trained for (max_position_embeddings)
    layer_norm_epsilon: float = 1e-5
    layer_norm_type: str = "rms"  # "rms" | "layer"
    mlp_type: str = "gated"  # "gated" (SwiGLU-style gate*up) | "plain" (fc_in -> act -> fc_out)
    activation_function: str = "silu"
    use_attention_bias: bool = False  # biases on q/k/v projections
    use_attn_proj_bias: bool = False  # bias on the attention output projection
    use_mlp_bias: bool = False
    qk_layernorm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    apply_rotary: bool = True
    rotary_base: float = 10000.0
    rotary_scaling: Optional[Dict[str, Any]] = None
    tied_embedding: bool = False
    is_critic: bool = False  # value head [hidden -> 1] instead of the LM head
    family: str = ""
    # Token ids carried along for generation defaults.
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        for k in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim", "hidden_dim", "intermediate_dim", "vocab_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ReaLModelConfig.{k} must be a positive integer, got {v!r}")
        if self.n_q_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_q_heads ({self.n_q_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.layer_norm_type not in ("rms", "layer"):
            raise ValueError(f"layer_norm_type must be 'rms' or 'layer', got {self.layer_norm_type!r}")
        if self.mlp_type not in ("gated", "plain"):
            raise ValueError(f"mlp_type must be 'gated' or 'plain', got {self.mlp_type!r}")

    def check_layout(self, tp: int, pp: int):
        """Raise a ValueError naming every model dimension that the layout does not divide."""
        problems = self.layout_problems(tp, pp)
        if problems:
            raise ValueError(f"layout m{tp}p{pp} does not fit this model: " + "; ".join(problems))

    def fits_layout(self, tp: int, pp: int) -> bool:
        """Whether tensor parallel size ``tp`` and ``pp`` pipeline stages divide this model (:meth:`check_layout`)."""
        return not self.layout_problems(tp, pp)

    def layout_problems(self, tp: int, pp: int) -> List[str]:
        """Every model dimension that the layout does not divide, in words."""
        problems = []
        # attention heads are split by key/value head groups, unevenly if need be (9 q / 3 kv heads over
        # tp=2 -> 6 + 3); every rank needs at least one key/value head
        if self.n_kv_heads < tp:
            problems.append(f"{self.n_kv_heads} key/value heads cannot be split over tensor parallel size {tp} "
                            "(each tensor rank needs at least one)")
        if self.intermediate_dim % tp:
            problems.append(f"MLP width {self.intermediate_dim} is not divisible by tensor parallel size {tp}")
        if self.vocab_size % tp:
            problems.append(f"vocabulary size {self.vocab_size} is not divisible by tensor parallel size {tp}")
        if pp > self.n_layers:
            problems.append(f"{self.n_layers} layers cannot fill {pp} pipeline stages")
        return problems


def even_range(total: int, parts: int, i: int) -> Tuple[int, int]:
    """[start, end) of part ``i`` when ``range(total)`` is cut into ``parts`` contiguous parts as even as
    possible, earlier parts taking the remainder (layers over stages, kv heads over tensor ranks, rows
    over generation groups)."""
    base, rem = divmod(total, parts)
    start = i * base + min(i, rem)
    return start, start + base + (1 if i < rem else 0)


def kv_head_partition(n_kv_heads: int, tp: int) -> List[Tuple[int, int]]:
    """(first kv head, number of kv heads) of every tensor rank: as even as possible, earlier ranks take
    the remainder. Query heads follow their kv head (GQA groups are never split), so 9 query / 3 kv heads
    over tp=2 become 6+3 query heads."""
    return [(s, e - s) for s, e in (even_range(n_kv_heads, tp, r) for r in range(tp))]


def stage_layer_range(n_layers: int, pp: int, stage: int) -> Tuple[int, int]:
    """[start, end) of the blocks held by pipeline stage ``stage`` (earlier stages take the remainder)."""
    return even_range(n_layers, pp, stage)


# ---------------------------------------------------------------------------------------------------
# HF family registry
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HFFamily:
    """How one Hugging Face model family maps onto ReaLModel.

    ``config_from_hf(hf_config) -> ReaLModelConfig`` and ``config_to_hf(cfg) -> dict`` convert configs;
    ``to_real(hf_name) -> (real_name, transform)`` / ``from_real(real_name)`` convert parameter names,
    where a transform may split one HF tensor into several ReaLModel tensors (GPT-2's fused qkv).
    """

    name: str
    hf_model_types: Tuple[str, ...]
    config_from_hf: Callable[[Any], ReaLModelConfig]
    config_to_hf: Callable[[ReaLModelConfig], Dict[str, Any]]
    hf_to_real: Callable[[Dict[str, Any], ReaLModelConfig], Dict[str, Any]]
    real_to_hf: Callable[[Dict[str, Any], ReaLModelConfig], Dict[str, Any]]
    hf_names_for_real: Callable[[List[str], ReaLModelConfig], List[str]]
    ignored_hf_keys: Tuple[str, ...] = ()


_HF_FAMILIES: Dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily):
    if family.name in _HF_FAMILIES:
        raise ValueError(f"HF family {family.name!r} registered twice")
    _HF_FAMILIES[family.name] = family


def get_hf_family(name: str) -> HFFamily:
    if name not in _HF_FAMILIES:
        raise KeyError(f"unknown HF family {name!r}; registered: {sorted(_HF_FAMILIES)}")
    return _HF_FAMILIES[name]


def hf_family_for_model_type(model_type: str) -> HFFamily:
    for fam in _HF_FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    supported = sorted(t for f in _HF_FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported: {supported}")


# ---------------------------------------------------------------------------------------------------
# Model interfaces: what a model function call does with a model (generate / inference / train_step)
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    """What an interface gets: one model role's shard on this worker, with its engine and tokenizer."""

    name: str
    engine: Any  # realhf.impl.model.backend.engine.InferenceEngine or TrainEngine
    tokenizer: Any
    grid: Any  # realhf.base.topology.ParallelGrid
    path: str
    version: int = 0  # number of train steps applied

    @property
    def module(self):
        return self.engine.model


class ModelInterface:
    """Algorithm-side code of an MFC. Methods run on every worker of the MFC's mesh with this worker's
    share of the batch (its data-parallel part); outputs returned by the last pipeline stage's tensor
    rank 0 are kept, the others are discarded."""

    def generate(self, model: Model, data, mb_spec) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement generate")

    def inference(self, model: Model, data, mb_spec) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement inference")

    def train_step(self, model: Model, data, mb_spec) -> Dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} does not implement train_step")

    def evaluate(self, model: Model, data_batches) -> Dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate")

    def warmup(self, model: Model) -> None:
        """Called once on the workers holding ``model`` before the first request: start, in the background,
        what the first call would otherwise start inside a step (must not block)."""

    def state_dict(self) -> Dict[str, Any]:
        """Algorithm state that must survive a restart (e.g. running statistics); plain data."""
        return {}

    def load_state_dict(self, state: Dict[str, Any], model: Model) -> None:
        """Restore :meth:`state_dict` (``model`` is this worker's shard of the MFC's model)."""


_INTERFACES: Dict[str, Callable[..., ModelInterface]] = {}


def register_interface(name: str, factory: Callable[..., ModelInterface]):
    if name in _INTERFACES:
        raise ValueError(f"interface {name!r} registered twice")
    _INTERFACES[name] = factory


def make_interface(name: str, **kwargs) -> ModelInterface:
    if name not in _INTERFACES:
        raise KeyError(f"unknown interface {name!r}; registered: {sorted(_INTERFACES)}")
    return _INTERFACES[name](**kwargs)
