"""Model shapes for planning: a ``ReaLModelConfig`` from a Hugging Face ``config.json`` (a dict or a model folder)
alone, or from a built-in table of real models' shapes by name, so that a plan needs no weights on this machine.

The table's rows are the fields of each model's published ``config.json`` on the Hugging Face Hub (the file named in
``source``), converted by the same registered HF family as a downloaded checkpoint would be. Their parameter counts
(``memory.params`` of the whole model) match the published ones: Qwen2.5-1.5B 1.54B, Qwen2.5-7B 7.62B, Llama-3.1-8B
8.03B, SmolLM2-135M 134.5M.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Union

from realhf.api.core.model_api import ReaLModelConfig


@dataclasses.dataclass(frozen=True)
class PublishedShape:
    """The fields of a model's ``config.json`` that fix its shape, and where they were read."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    source: str

    def hf_config(self) -> Dict:
        return dict(model_type=self.model_type, hidden_size=self.hidden, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    intermediate_size=self.intermediate, vocab_size=self.vocab, tie_word_embeddings=self.tied,
                    max_position_embeddings=32768, rope_theta=1e6 if self.model_type == "qwen2" else 5e5)


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


SHAPES: Dict[str, PublishedShape] = {
    "qwen2.5-0.5b": PublishedShape("qwen2", 896, 24, 14, 2, 4864, 151936, True, _hub("Qwen/Qwen2.5-0.5B")),
    "qwen2.5-1.5b": PublishedShape("qwen2", 1536, 28, 12, 2, 8960, 151936, True, _hub("Qwen/Qwen2.5-1.5B")),
    "qwen2.5-7b": PublishedShape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, _hub("Qwen/Qwen2.5-7B")),
    "qwen2.5-14b": PublishedShape("qwen2", 5120, 48, 40, 8, 13824, 152064, False, _hub("Qwen/Qwen2.5-14B")),
    "qwen2.5-32b": PublishedShape("qwen2", 5120, 64, 40, 8, 27648, 152064, False, _hub("Qwen/Qwen2.5-32B")),
    "r1-distill-qwen-1.5b": PublishedShape("qwen2", 1536, 28, 12, 2, 8960, 151936, False,
                                           _hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")),
    "r1-distill-qwen-7b": PublishedShape("qwen2", 3584, 28, 28, 4, 18944, 152064, False,
                                         _hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")),
    "r1-distill-qwen-32b": PublishedShape("qwen2", 5120, 64, 40, 8, 27648, 152064, False,
                                          _hub("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B")),
    "llama-3.1-8b": PublishedShape("llama", 4096, 32, 32, 8, 14336, 128256, False,
                                   _hub("meta-llama/Llama-3.1-8B")),
    "smollm2-135m": PublishedShape("llama", 576, 30, 9, 3, 1536, 49152, True,
                                   _hub("HuggingFaceTB/SmolLM2-135M-Instruct")),
}


def shape_of_folder(path: str) -> Optional[str]:
    """The name in :data:`SHAPES` of the model a folder is named after (``/models/DeepSeek-R1-Distill-Qwen-7B`` ->
    ``r1-distill-qwen-7b``; a trailing ``-instruct`` ignored), or None."""
    name = os.path.basename(os.path.normpath(path)).lower()
    for cand in (name, name[:-len("-instruct")] if name.endswith("-instruct") else name):
        if cand in SHAPES:
            return cand
        hits = [k for k in SHAPES if cand.endswith("-" + k) or cand.endswith("/" + k)]
        if hits:
            return max(hits, key=len)
    return None


def config_from_hf_dict(hf: Dict, is_critic: bool = False) -> ReaLModelConfig:
    """A ``ReaLModelConfig`` from the contents of a ``config.json``, by the HF family registered for its
    ``model_type``."""
    import realhf.impl.model.conversion.families  # noqa: F401  (registers the families; torch-free)
    from realhf.api.core.model_api import hf_family_for_model_type

    if "model_type" not in hf:
        raise ValueError(f"config.json has no 'model_type' (keys: {sorted(hf)[:12]})")
    fam = hf_family_for_model_type(hf["model_type"])
    try:
        cfg = fam.config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.json is incomplete or invalid for a {hf['model_type']} model: {e}") from None
    cfg.is_critic = is_critic
    return cfg


def model_config(model: Union[str, Dict, ReaLModelConfig], is_critic: bool = False) -> ReaLModelConfig:
    """The shape of ``model``: a ``ReaLModelConfig`` as is, a ``config.json`` dict, a model folder holding a
    ``config.json``, or a name of :data:`SHAPES` (case-insensitive)."""
    if isinstance(model, ReaLModelConfig):
        return model
    if isinstance(model, dict):
        return config_from_hf_dict(model, is_critic)
    if not isinstance(model, str):
        raise TypeError(f"model: expected a name, a model folder, a config.json dict or a ReaLModelConfig, "
                        f"got {type(model).__name__}")
    key = model.lower()
    if key in SHAPES:
        return config_from_hf_dict(SHAPES[key].hf_config(), is_critic)
    if os.path.isdir(model):
        from realhf.impl.model.conversion.hf_files import config_from_hf_path

        return config_from_hf_path(model, is_critic)
    raise ValueError(f"model {model!r} is neither a model folder nor a known shape; known shapes: {sorted(SHAPES)}")


def shape_of(path: str, is_critic: bool = False) -> ReaLModelConfig:
    """The shape of the model folder ``path``: its ``config.json``, or, when planning for another cluster, the tabled
    shape standing in for it (``realhf.api.quickstart.stand_ins``)."""
    from realhf.api.quickstart import stand_ins

    if stand_ins.is_stand_in(path):
        return config_from_hf_dict(stand_ins.hf_config(path), is_critic)
    from realhf.impl.model.conversion.hf_files import config_from_hf_path

    return config_from_hf_path(path, is_critic)


def n_params(cfg: ReaLModelConfig) -> int:
    """Parameters of the whole model (tied embeddings counted once)."""
    from realhf.plan.memory import Shard, params

    return params(Shard(cfg))
