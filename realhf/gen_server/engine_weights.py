"""Weight updates of realhf's generation engine (``realhf_engine.py``), run on its engine thread between decode
steps: from a Hugging Face folder on disk, or received tensor by tensor over a weight group. Everything is checked
before the first parameter changes (the version, which never goes backwards; the architecture; every tensor's name
and shape; from disk also that every value is finite); an update that fails after that leaves a mix of weights, and
the engine then fails every request and refuses new ones until a complete update (``_mark_broken``)."""
from __future__ import annotations

import dataclasses
import re
from typing import List, Tuple

import torch

from realhf.base import logging
from realhf.gen_server.api import RequestError, TensorMeta
from realhf.impl.model.nn import cpu_gemm

logger = logging.getLogger("realhf.gen_server.engine")

# The only ReaLModelConfig fields a weight update from disk may change: the served model keeps its config, so
# a folder whose architecture differs anywhere else would be run wrongly.
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class _Staged:
    """``model`` for ``load_hf_into`` whose parameter copies are held back: ``load_hf_into`` reads and checks every
    tensor and then copies each into ``local_param(name)``; here that copy only notes ``(name, values)``, so the
    values can be checked (finite) before the first parameter changes, and applied after (``apply``)."""

    def __init__(self, model):
        self._model = model
        self.staged: List[Tuple[str, torch.Tensor]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def local_param(self, name: str) -> "_Sink":
        return _Sink(self.staged, name)

    def apply(self):
        for name, t in self.staged:
            self._model.local_param(name).copy_(t)


class _Sink:
    __slots__ = ("staged", "name")

    def __init__(self, staged: list, name: str):
        self.staged, self.name = staged, name

    def copy_(self, src: torch.Tensor):
        self.staged.append((self.name, src))


class EngineWeights:
    """The weight-update part of ``RealhfEngine`` (a mixin: it uses the engine's model, request state, counters and
    ``_fail``)."""

    def _load_from_disk(self, path: str, version: int):
        """Load the HF folder ``path`` as ``version``. Refused (``RequestError``), with the served weights unchanged:
        an older version than the served one, a folder without config.json or weights, another architecture, a
        tensor the served model does not have, a missing tensor or shape, a non-finite value."""
        from realhf.impl.model.conversion.hf_io import config_from_hf_path, load_hf_into

        self._check_version(version)
        try:
            self._check_config(config_from_hf_path(path), path)
            self._check_names(path)
            staged = _Staged(self.model)
            load_hf_into(staged, path)  # reads and checks every tensor; copies nothing yet
        except FileNotFoundError as e:
            raise RequestError(f"cannot load weights from {path!r}: {e}") from None
        self._check_finite(staged.staged, path)
        cpu_gemm.drop_packed()
        try:
            staged.apply()
        except Exception as e:
            self._mark_broken(e)
            raise
        self._updated(version)

    def _check_version(self, version: int):
        if int(version) < self._version:
            raise RequestError(f"version={version} is older than the served version {self._version}; weight "
                               "versions never go backwards (every token carries the version that made it)")

    def _check_names(self, path: str):
        """Refuse a folder holding tensors the served model does not have (reads the files' headers only)."""
        from realhf.api.core.model_api import get_hf_family
        from realhf.impl.model.conversion.hf_files import _weight_files
        from realhf.impl.model.nn.real_model import tied_source_name

        cfg = self.model.config
        fam = get_hf_family(cfg.family)
        real = list(dict.fromkeys(tied_source_name(cfg, n) for n in self.model.param_spec))
        if cfg.tied_embedding and not cfg.is_critic:
            real.append("head.lm_head.weight")  # a tied checkpoint may hold its head too; the embedding is served
        known = set(fam.hf_names_for_real(real, cfg))
        extra = [n for n in _weight_files(path)
                 if n not in known and not any(re.search(p, n) for p in fam.ignored_hf_keys)]
        if extra:
            raise RequestError(f"the checkpoint at {path!r} holds {len(extra)} tensors the served {cfg.family} model "
                               f"does not have: {extra[:5]}{' ...' if len(extra) > 5 else ''}; nothing was loaded")

    def _check_finite(self, staged: List[Tuple[str, torch.Tensor]], path: str):
        from realhf.api.core.model_api import get_hf_family
        from realhf.impl.model.conversion.hf_io import n_nonfinite
        from realhf.impl.model.nn.real_model import tied_source_name

        cfg = self.model.config
        counts = [(n, n_nonfinite([t])) for n, t in staged]  # one summing pass per tensor when all are finite
        bad = [(n, k) for n, k in counts if k]
        if bad:
            hf = get_hf_family(cfg.family).hf_names_for_real
            names = [f"{'/'.join(hf([tied_source_name(cfg, n)], cfg))} ({k} values)" for n, k in bad[:5]]
            raise RequestError(f"the checkpoint at {path!r} holds NaN or infinite values in {len(bad)} tensors: "
                               + ", ".join(names) + ("..." if len(bad) > 5 else "") + "; nothing was loaded")

    def _updated(self, version: int):
        cpu_gemm.drop_packed()
        self._version = int(version)
        self._broken = None
        self._stats["weight_updates"] += 1

    def _mark_broken(self, e: BaseException):
        """A weight update failed after replacing some parameters: the weights are a mix. Fail every request
        (their tokens would come from no real model) and refuse new ones until a complete update."""
        self._broken = f"{type(e).__name__}: {e}"
        logger.error("generation engine: weights incomplete after a failed update: %s", self._broken)
        exc = RuntimeError(f"the weight update failed midway ({self._broken}); the served weights are incomplete")
        for r in self._waiting + list({id(row.req): row.req for row in self._rows}.values()):
            self._fail(r, exc)
        self._waiting, self._rows, self._groups, self._tok = [], [], [], None
        if self._cache is not None:
            self._cache.remove([])
        self._update_counts()

    def _check_config(self, new, path: str):
        cur = self.model.config
        diff = [f.name for f in dataclasses.fields(cur)
                if f.name not in _TOKEN_ID_FIELDS and getattr(cur, f.name) != getattr(new, f.name)]
        if diff:
            raise ValueError(f"the model at {path!r} is not the served architecture: its config differs in "
                             + ", ".join(f"{k} ({getattr(new, k)!r}, served: {getattr(cur, k)!r})" for k in diff))

    def _plan_tensors(self, metas: List[TensorMeta]) -> Tuple[List[List[Tuple[str, str]]], List[str]]:
        """What each HF tensor of an in-memory update becomes, from names and shapes alone: per tensor
        ``[(real name, target parameter)]``, and the problems found (a tensor the served model does not have, a
        shape that does not fit)."""
        from realhf.api.core.model_api import get_hf_family
        from realhf.impl.model.nn.real_model import tied_source_name

        model, cfg = self.model, self.model.config
        fam = get_hf_family(cfg.family)
        local = model.param_spec
        plans: List[List[Tuple[str, str]]] = []
        errors: List[str] = []
        sent_real = set()
        conv_meta = []
        for m in metas:
            try:
                conv = fam.hf_to_real({m.name: torch.empty(m.shape, device="meta")}, cfg)
            except Exception as e:
                conv = {}
                errors.append(f"{m.name}: cannot convert ({type(e).__name__}: {e})")
            conv_meta.append(conv)
            sent_real.update(conv)
        tied = cfg.tied_embedding and not cfg.is_critic
        for m, conv in zip(metas, conv_meta):
            plan = []
            for real, t in conv.items():
                if real.startswith("<unknown>"):
                    errors.append(f"{m.name}: not a tensor of a {cfg.family} model")
                    continue
                targets = [n for n in local if tied_source_name(cfg, n) == real]
                if not targets and tied and real == "head.lm_head.weight":
                    # a tied model's head is its embedding: take it only when the embedding is not sent too
                    if "embed.wte.weight" not in sent_real:
                        targets = ["embed.wte.weight"]
                    else:
                        continue
                if not targets:
                    errors.append(f"{m.name}: no parameter {real} in the served model")
                    continue
                for n in targets:
                    if tuple(t.shape) != tuple(model.full_shape(n)):
                        errors.append(f"{m.name}: shape {tuple(m.shape)} does not fit {n} "
                                      f"{tuple(model.full_shape(n))}")
                    else:
                        plan.append((real, n))
            plans.append(plan)
        return plans, errors

    def _copy_in(self, received, plans: List[List[Tuple[str, str]]], skip: bool):
        """Copy each ``(HF name, tensor)`` of ``received`` into its parameters by ``plans`` (``skip``: only take
        them, e.g. to stay in step with a weight group); a failure after the first copy marks the weights broken."""
        from realhf.api.core.model_api import get_hf_family

        model, cfg = self.model, self.model.config
        fam = get_hf_family(cfg.family)
        copied = False
        cpu_gemm.drop_packed()
        try:
            for (name, t), plan in zip(received, plans):
                if skip or not plan:
                    continue
                conv = fam.hf_to_real({name: t}, cfg)
                for real, n in plan:
                    copied = True
                    model.local_param(n).copy_(conv[real])
        except Exception as e:
            if copied:
                self._mark_broken(e)
            raise

    @staticmethod
    def _refuse(errors: List[str], how: str):
        if errors:
            raise ValueError(f"weight update {how}: {len(errors)} unusable tensors, nothing loaded: "
                             + "; ".join(errors[:5]) + (" ..." if len(errors) > 5 else ""))

    def _load_from_group(self, metas: List[TensorMeta], version: int):
        """Receive every tensor of ``metas`` (always all of them, so the group stays in step with the trainer
        even when one is unusable), copying each into its parameter; raise after the last one if any was
        unusable (those are checked from ``metas`` before anything is copied)."""
        from realhf.gen_server.weight_group import receive

        plans, errors = self._plan_tensors(metas)
        stale = int(version) < self._version  # refused after the receive (raised by _check_version)
        self._copy_in(receive(self._weight_group, metas), plans, skip=bool(errors) or stale)
        self._check_version(version)
        self._refuse(errors, "over the group")
        self._updated(version)

    def _load_from_shared(self, parts: List[dict], version: int):
        """Copy the tensors of ``parts`` (shared by the trainer on this host: ``realhf.gen_server.weight_share``)
        into the parameters. Everything is checked before the first copy: the version, every part, every tensor's
        name and shape."""
        from realhf.gen_server.weight_share import check_parts, open_parts

        self._check_version(version)
        entries = check_parts(parts)
        metas = [TensorMeta(name=t["name"], dtype=t["dtype"], shape=t["shape"]) for t in entries]
        plans, errors = self._plan_tensors(metas)
        self._refuse(errors, "from shared memory")
        self._copy_in(open_parts(parts), plans, skip=False)
        self._updated(version)
