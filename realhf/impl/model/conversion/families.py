"""Hugging Face families: config and parameter-name conversion to and from ReaLModel.

Each family registers itself with ``register_hf_family``. Name conversion works on plain dicts of
tensors; only the tensors of the layers a rank holds are ever passed in.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, List

from realhf.api.core.model_api import HFFamily, ReaLModelConfig, register_hf_family

if TYPE_CHECKING:  # torch is imported where tensors are converted: the launcher reads configs without it
    import torch

# ---------------------------------------------------------------------------------------------------
# Llama-like families (Llama, Mistral, Qwen2, Qwen3): same tensor names, different options.
# ---------------------------------------------------------------------------------------------------

_LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_LLAMA_BLOCK_INV = {v: k for k, v in _LLAMA_BLOCK.items()}
_LLAMA_TOP = {"model.embed_tokens.weight": "embed.wte.weight", "model.norm.weight": "head.norm.weight",
              "lm_head.weight": "head.lm_head.weight", "score.weight": "head.value.weight"}
_LLAMA_TOP_INV = {v: k for k, v in _LLAMA_TOP.items()}


def _cfg_get(c, k, default=None):
    return getattr(c, k, default) if not isinstance(c, dict) else c.get(k, default)


def _rope_scaling(c):
    rs = _cfg_get(c, "rope_scaling")
    if rs is None:
        rp = _cfg_get(c, "rope_parameters")
        if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
            rs = rp
    return dict(rs) if rs else None


def _rope_theta(c):
    theta = _cfg_get(c, "rope_theta")
    if theta is None:
        rp = _cfg_get(c, "rope_parameters")
        if isinstance(rp, dict):
            theta = rp.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _llama_like_config(c, family: str, attn_bias: bool, qk_norm: bool) -> ReaLModelConfig:
    n_q = _cfg_get(c, "num_attention_heads")
    H = _cfg_get(c, "hidden_size")
    head_dim = _cfg_get(c, "head_dim") or H // n_q
    if family == "llama":
        attn_bias = bool(_cfg_get(c, "attention_bias", False))
    return ReaLModelConfig(
        n_layers=_cfg_get(c, "num_hidden_layers"),
        n_q_heads=n_q,
        n_kv_heads=_cfg_get(c, "num_key_value_heads") or n_q,
        head_dim=head_dim,
        hidden_dim=H,
        intermediate_dim=_cfg_get(c, "intermediate_size"),
        vocab_size=_cfg_get(c, "vocab_size"),
        layer_norm_epsilon=_cfg_get(c, "rms_norm_eps", 1e-6),
        layer_norm_type="rms",
        mlp_type="gated",
        activation_function=_cfg_get(c, "hidden_act", "silu"),
        use_attention_bias=attn_bias,
        use_attn_proj_bias=bool(_cfg_get(c, "attention_bias", False)) if family == "llama" else False,
        use_mlp_bias=bool(_cfg_get(c, "mlp_bias", False)),
        qk_layernorm=qk_norm,
        apply_rotary=True,
        rotary_base=_rope_theta(c),
        rotary_scaling=_rope_scaling(c),
        tied_embedding=bool(_cfg_get(c, "tie_word_embeddings", False)),
        max_positions=_cfg_get(c, "max_position_embeddings"),
        family=family,
        bos_token_id=_cfg_get(c, "bos_token_id"),
        eos_token_id=_first(_cfg_get(c, "eos_token_id")),
        pad_token_id=_cfg_get(c, "pad_token_id"),
    )


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


def _llama_like_to_hf(cfg: ReaLModelConfig, model_type: str, arch: str) -> dict:
    d = dict(
        model_type=model_type,
        architectures=[arch],
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_q_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_dim,
        intermediate_size=cfg.intermediate_dim,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.layer_norm_epsilon,
        hidden_act=cfg.activation_function,
        rope_theta=cfg.rotary_base,
        rope_scaling=cfg.rotary_scaling,
        tie_word_embeddings=cfg.tied_embedding,
        max_position_embeddings=cfg.max_positions or cfg.n_positions or 32768,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        torch_dtype="float32",
    )
    if model_type == "llama":
        d["attention_bias"] = cfg.use_attention_bias
        d["mlp_bias"] = cfg.use_mlp_bias
    return d


_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_REAL_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _llama_hf_to_real(sd: Dict[str, torch.Tensor], cfg: ReaLModelConfig) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        m = _BLOCK_RE.match(k)
        if m and m.group(2) in _LLAMA_BLOCK:
            out[f"blocks.{m.group(1)}.{_LLAMA_BLOCK[m.group(2)]}"] = v
        elif k in _LLAMA_TOP:
            out[_LLAMA_TOP[k]] = v
        else:
            out[f"<unknown>{k}"] = v
    return out


def _llama_real_to_hf(sd: Dict[str, torch.Tensor], cfg: ReaLModelConfig) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        m = _REAL_BLOCK_RE.match(k)
        if m:
            out[f"model.layers.{m.group(1)}.{_LLAMA_BLOCK_INV[m.group(2)]}"] = v
        else:
            out[_LLAMA_TOP_INV[k]] = v
    return out


def _llama_hf_names(real_names: List[str], cfg: ReaLModelConfig) -> List[str]:
    out = []
    for k in real_names:
        m = _REAL_BLOCK_RE.match(k)
        if m:
            out.append(f"model.layers.{m.group(1)}.{_LLAMA_BLOCK_INV[m.group(2)]}")
        else:
            out.append(_LLAMA_TOP_INV[k])
    return out


def _register_llama_like(name, model_types, arch, attn_bias, qk_norm):
    register_hf_family(
        HFFamily(
            name=name,
            hf_model_types=model_types,
            config_from_hf=lambda c: _llama_like_config(c, name, attn_bias, qk_norm),
            config_to_hf=lambda cfg: _llama_like_to_hf(cfg, model_types[0], arch),
            hf_to_real=_llama_hf_to_real,
            real_to_hf=_llama_real_to_hf,
            hf_names_for_real=_llama_hf_names,
            ignored_hf_keys=(r"rotary_emb\.inv_freq$",),
        )
    )


_register_llama_like("llama", ("llama", "mistral"), "LlamaForCausalLM", attn_bias=False, qk_norm=False)
_register_llama_like("qwen2", ("qwen2",), "Qwen2ForCausalLM", attn_bias=True, qk_norm=False)
_register_llama_like("qwen3", ("qwen3",), "Qwen3ForCausalLM", attn_bias=False, qk_norm=True)

# ---------------------------------------------------------------------------------------------------
# GPT-2: learned positions, LayerNorm, GELU, fused qkv stored as Conv1D ([in, out]) weights.
# ---------------------------------------------------------------------------------------------------

_GPT2_BLOCK = {
    "ln_1.weight": "attn_norm.weight",
    "ln_1.bias": "attn_norm.bias",
    "attn.c_proj.weight": "attn.o_proj.weight",
    "attn.c_proj.bias": "attn.o_proj.bias",
    "ln_2.weight": "mlp_norm.weight",
    "ln_2.bias": "mlp_norm.bias",
    "mlp.c_fc.weight": "mlp.fc_in.weight",
    "mlp.c_fc.bias": "mlp.fc_in.bias",
    "mlp.c_proj.weight": "mlp.fc_out.weight",
    "mlp.c_proj.bias": "mlp.fc_out.bias",
}
_GPT2_BLOCK_INV = {v: k for k, v in _GPT2_BLOCK.items()}
_GPT2_TOP = {"transformer.wte.weight": "embed.wte.weight", "transformer.wpe.weight": "embed.wpe.weight",
             "transformer.ln_f.weight": "head.norm.weight", "transformer.ln_f.bias": "head.norm.bias",
             "lm_head.weight": "head.lm_head.weight", "score.weight": "head.value.weight"}
_GPT2_TOP_INV = {v: k for k, v in _GPT2_TOP.items()}
_GPT2_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")
_CONV1D = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gpt2_config(c) -> ReaLModelConfig:
    H = _cfg_get(c, "n_embd")
    nh = _cfg_get(c, "n_head")
    return ReaLModelConfig(
        n_layers=_cfg_get(c, "n_layer"),
        n_q_heads=nh,
        n_kv_heads=nh,
        head_dim=H // nh,
        hidden_dim=H,
        intermediate_dim=_cfg_get(c, "n_inner") or 4 * H,
        vocab_size=_cfg_get(c, "vocab_size"),
        n_positions=_cfg_get(c, "n_positions"),
        layer_norm_epsilon=_cfg_get(c, "layer_norm_epsilon", 1e-5),
        layer_norm_type="layer",
        mlp_type="plain",
        activation_function=_cfg_get(c, "activation_function", "gelu_new"),
        use_attention_bias=True,
        use_attn_proj_bias=True,
        use_mlp_bias=True,
        apply_rotary=False,
        tied_embedding=bool(_cfg_get(c, "tie_word_embeddings", True)),
        family="gpt2",
        bos_token_id=_cfg_get(c, "bos_token_id"),
        eos_token_id=_first(_cfg_get(c, "eos_token_id")),
        pad_token_id=_cfg_get(c, "pad_token_id"),
    )


def _gpt2_to_hf(cfg: ReaLModelConfig) -> dict:
    if _cfg_unsupported_by_gpt2(cfg):
        raise ValueError("this ReaLModelConfig cannot be written as a GPT-2 checkpoint")
    return dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=cfg.n_layers, n_head=cfg.n_q_heads,
        n_embd=cfg.hidden_dim, n_inner=cfg.intermediate_dim, vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions, layer_norm_epsilon=cfg.layer_norm_epsilon,
        activation_function=cfg.activation_function, tie_word_embeddings=cfg.tied_embedding,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        torch_dtype="float32",
    )


def _cfg_unsupported_by_gpt2(cfg):
    return cfg.n_kv_heads != cfg.n_q_heads or cfg.apply_rotary or cfg.mlp_type != "plain"


def _gpt2_hf_to_real(sd, cfg):
    out = {}
    H = cfg.hidden_dim
    for k, v in sd.items():
        m = _GPT2_RE.match(k)
        if m:
            i, rest = m.group(1), m.group(2)
            if rest == "attn.c_attn.weight":  # [H, 3H] Conv1D
                q, kk, vv = v.t().split(H, dim=0)
                out[f"blocks.{i}.attn.q_proj.weight"] = q
                out[f"blocks.{i}.attn.k_proj.weight"] = kk
                out[f"blocks.{i}.attn.v_proj.weight"] = vv
            elif rest == "attn.c_attn.bias":
                q, kk, vv = v.split(H, dim=0)
                out[f"blocks.{i}.attn.q_proj.bias"] = q
                out[f"blocks.{i}.attn.k_proj.bias"] = kk
                out[f"blocks.{i}.attn.v_proj.bias"] = vv
            elif rest in _GPT2_BLOCK:
                out[f"blocks.{i}.{_GPT2_BLOCK[rest]}"] = v.t() if rest in _CONV1D else v
            else:
                out[f"<unknown>{k}"] = v
        else:
            key = k if k.startswith(("transformer.", "lm_head", "score")) else f"transformer.{k}"
            out[_GPT2_TOP[key] if key in _GPT2_TOP else f"<unknown>{k}"] = v
    return out


def _gpt2_real_to_hf(sd, cfg):
    import torch

    out = {}
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m = _REAL_BLOCK_RE.match(k)
        if m:
            i, rest = m.group(1), m.group(2)
            mm = re.match(r"attn\.([qkv])_proj\.(weight|bias)$", rest)
            if mm:
                pending.setdefault(f"{i}.{mm.group(2)}", {})[mm.group(1)] = v
                continue
            hf = _GPT2_BLOCK_INV[rest]
            out[f"transformer.h.{i}.{hf}"] = v.t().contiguous() if hf in _CONV1D else v
        else:
            out[_GPT2_TOP_INV[k]] = v
    for key, parts in pending.items():
        i, kind = key.split(".")
        cat = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
        out[f"transformer.h.{i}.attn.c_attn.{kind}"] = cat.t().contiguous() if kind == "weight" else cat
    return out


def _gpt2_hf_names(real_names, cfg):
    out = set()
    for k in real_names:
        m = _REAL_BLOCK_RE.match(k)
        if m:
            i, rest = m.group(1), m.group(2)
            mm = re.match(r"attn\.[qkv]_proj\.(weight|bias)$", rest)
            out.add(f"transformer.h.{i}.attn.c_attn.{mm.group(1)}" if mm else f"transformer.h.{i}.{_GPT2_BLOCK_INV[rest]}")
        else:
            out.add(_GPT2_TOP_INV[k])
    return sorted(out)


register_hf_family(
    HFFamily(
        name="gpt2",
        hf_model_types=("gpt2",),
        config_from_hf=_gpt2_config,
        config_to_hf=_gpt2_to_hf,
        hf_to_real=_gpt2_hf_to_real,
        real_to_hf=_gpt2_real_to_hf,
        hf_names_for_real=_gpt2_hf_names,
        ignored_hf_keys=(r"attn\.bias$", r"attn\.masked_bias$"),
    )
)
