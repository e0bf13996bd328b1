"""Rollout workflows of asynchronous RL: what one episode produces and how workflows are found.

A *workflow* (AReaL's ``RolloutWorkflow``) turns one dataset row into one :class:`Trajectory`:
``await workflow.arun_episode(engine, data)`` generates on the generation servers through ``engine`` (a
``realhf.system.rollout.engine.RolloutEngine``: ``await engine.agenerate(input_ids, sampling, rid, prefer=None)``
-> ``GenerateResult``, ``engine.tokenizer``, ``engine.version``), scores the answers and returns the group of
``n`` answers of the prompt, or None to reject the episode.

A :class:`Trajectory` becomes the one sample the trainer consumes per episode (:meth:`Trajectory.to_sample`),
with exactly the keys a synchronous run's ``actor_gen`` + ``rew_inf`` produce
(``realhf.impl.model.interface.gen_interface``), per sequence of the group:

* ``packed_input_ids`` (int64): prompt + answer (multi-turn: + feedback tokens + next answer ...);
* ``packed_logprobs`` (float32): entry ``t`` is the behaviour policy's log-prob of token ``t+1``; 0 where token
  ``t+1`` was not generated (and on the last position);
* ``prompt_mask`` (bool): True on every token the policy did not generate (the prompt, inserted feedback);
* ``packed_versions`` (int32): the weight version that generated token ``t``; -1 on non-generated tokens;
* ``seq_no_eos_mask`` (bool, one per sequence): the answer ended without a stop token;
* ``rewards`` (float32, one per sequence);

and the metadata ``query_id``. Workflows register by name (:func:`register_workflow`); :func:`make_workflow`
takes a registered name or an import path ``"package.module:ClassName"``.

This module imports nothing of ``realhf.impl`` or ``realhf.system``; the registered workflows are defined (and
register themselves) in ``realhf.impl.workflow``: import it before making one by name.
"""
from __future__ import annotations

import abc
import dataclasses
import importlib
import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Type

if TYPE_CHECKING:  # torch only where a trajectory becomes tensors: the launcher checks a workflow without it
    from realhf.api.core.data_api import SequenceSample

TRAJECTORY_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask", "packed_versions", "seq_no_eos_mask",
                   "rewards")
_DTYPE_NAMES = {"packed_input_ids": "long", "packed_logprobs": "float32", "prompt_mask": "bool",
                "packed_versions": "int32", "seq_no_eos_mask": "bool", "rewards": "float32"}


@dataclasses.dataclass
class AnswerSample:
    """One sequence of a group, token-aligned (every list has ``len(input_ids)`` entries; see the module
    docstring for what each holds). Checked on construction: the lengths, that the first token is not generated
    (nothing precedes it), that ``versions`` is -1 exactly on non-generated tokens, that ``logprobs`` is 0 where
    the next token is not generated, and that the reward is a finite number."""

    input_ids: List[int]
    prompt_mask: List[bool]
    logprobs: List[float]
    versions: List[int]
    no_eos: bool
    reward: float

    def __post_init__(self):
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("AnswerSample.input_ids is empty: a sequence holds at least the prompt")
        for name in ("prompt_mask", "logprobs", "versions"):
            m = len(getattr(self, name))
            if m != n:
                raise ValueError(f"AnswerSample.{name} has {m} entries but input_ids has {n}; every list is aligned "
                                 "with input_ids (one entry per token)")
        self.input_ids = [int(t) for t in self.input_ids]
        self.prompt_mask = [bool(x) for x in self.prompt_mask]
        self.logprobs = [float(x) for x in self.logprobs]
        self.versions = [int(v) for v in self.versions]
        if not self.prompt_mask[0]:
            raise ValueError("AnswerSample.prompt_mask[0] is False: the first token cannot be generated (nothing "
                             "precedes it); it must be a prompt token")
        for t, (pm, v) in enumerate(zip(self.prompt_mask, self.versions)):
            if pm and v != -1:
                raise ValueError(f"AnswerSample.versions[{t}] = {v} on a non-generated token (prompt_mask True); "
                                 "non-generated tokens carry version -1")
            if not pm and v < 0:
                raise ValueError(f"AnswerSample.versions[{t}] = {v} on a generated token; a generated token carries "
                                 "the weight version (>= 0) that produced it")
        for t in range(n):
            nxt_generated = t + 1 < n and not self.prompt_mask[t + 1]
            lp = self.logprobs[t]
            if not nxt_generated and lp != 0.0:
                raise ValueError(f"AnswerSample.logprobs[{t}] = {lp} but token {t + 1} is "
                                 f"{'not generated' if t + 1 < n else 'past the end'}; logprobs[t] is the log-prob "
                                 "of token t+1 and must be 0 where that token was not generated")
            if nxt_generated and not math.isfinite(lp):
                raise ValueError(f"AnswerSample.logprobs[{t}] = {lp} is not a finite log-probability")
        self.no_eos = bool(self.no_eos)
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"AnswerSample.reward must be a finite number, got {self.reward!r}")
        self.reward = float(self.reward)

    @property
    def n_generated(self) -> int:
        return sum(1 for pm in self.prompt_mask if not pm)


@dataclasses.dataclass
class Trajectory:
    """The group of answers of one prompt (one episode) and the episode's stats (plain floats, averaged over
    episodes by whoever logs them)."""

    query_id: str
    samples: List[AnswerSample]
    stats: Dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.query_id, str):
            raise ValueError(f"Trajectory.query_id must be a str, got {type(self.query_id).__name__} {self.query_id!r}")
        if not self.samples:
            raise ValueError(f"Trajectory of query {self.query_id!r} has no samples; return None from arun_episode "
                             "to reject an episode instead")
        for i, s in enumerate(self.samples):
            if not isinstance(s, AnswerSample):
                raise ValueError(f"Trajectory.samples[{i}] is a {type(s).__name__}, not an AnswerSample")
        self.stats = {str(k): float(v) for k, v in (self.stats or {}).items()}

    @property
    def n(self) -> int:
        return len(self.samples)

    def rewards(self) -> List[float]:
        return [s.reward for s in self.samples]

    def rewards_all_equal(self) -> bool:
        """Every answer got the same reward (always True for a group of one): a group-normalised advantage is
        then zero on every token, so dynamic filtering drops such groups."""
        r = self.rewards()
        return all(x == r[0] for x in r)

    def _gen_versions(self) -> List[int]:
        return [v for s in self.samples for v, pm in zip(s.versions, s.prompt_mask) if not pm]

    def min_version(self) -> int:
        """Oldest weight version behind any generated token of the group (-1 when nothing was generated)."""
        return min(self._gen_versions(), default=-1)

    def max_version(self) -> int:
        """Newest weight version behind any generated token of the group (-1 when nothing was generated)."""
        return max(self._gen_versions(), default=-1)

    def to_sample(self, sample_id) -> SequenceSample:
        """One :class:`SequenceSample` (id ``sample_id``) holding the group's ``n`` sequences under the keys of
        the module docstring, and the metadata ``query_id``."""
        import torch

        from realhf.api.core.data_api import SequenceSample

        lens = [len(s.input_ids) for s in self.samples]
        seqlens = {k: [list(lens)] for k in ("packed_input_ids", "packed_logprobs", "prompt_mask", "packed_versions")}
        seqlens["seq_no_eos_mask"] = [[1] * self.n]
        seqlens["rewards"] = [[1] * self.n]
        dtypes = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items()}
        values = {
            "packed_input_ids": [t for s in self.samples for t in s.input_ids],
            "packed_logprobs": [x for s in self.samples for x in s.logprobs],
            "prompt_mask": [x for s in self.samples for x in s.prompt_mask],
            "packed_versions": [v for s in self.samples for v in s.versions],
            "seq_no_eos_mask": [s.no_eos for s in self.samples],
            "rewards": [s.reward for s in self.samples],
        }
        data = {k: torch.tensor(v, dtype=dtypes[k]) for k, v in values.items()}
        return SequenceSample(keys=set(TRAJECTORY_KEYS), ids=[sample_id], seqlens=seqlens,
                              trailing_shapes={k: () for k in TRAJECTORY_KEYS}, dtypes=dtypes, data=data,
                              metadata={"query_id": [self.query_id]})


class RolloutWorkflow(abc.ABC):
    """One kind of episode. Instances are shared by the many episodes a rollout worker runs concurrently on one
    event loop: keep per-episode state in locals, and never block the loop (CPU-heavy or blocking work, such as
    grading, goes to an executor)."""

    @abc.abstractmethod
    async def arun_episode(self, engine, data: Dict[str, Any]) -> Optional[Trajectory]:
        """Run one episode for the dataset row ``data`` (see :func:`episode_data`); None rejects it."""

    @classmethod
    def seq_len_budget(cls, max_prompt_len: int, max_new_tokens: int, **workflow_args) -> int:
        """The longest sequence an episode may build (prompt, every generated and inserted token): the generation
        servers are sized for it. One turn by default; a workflow that inserts tokens or runs several turns says
        more. A workflow whose constructor takes ``max_seq_len`` is given this budget, so it can keep to it (and one that
        takes ``use_chat_template`` is told whether the prompts are chat turns)."""
        return int(max_prompt_len) + int(max_new_tokens)


# ---------------------------------------------------------------------------------------------------- registry
_WORKFLOWS: Dict[str, Type[RolloutWorkflow]] = {}


def register_workflow(name: str, cls: Type[RolloutWorkflow]) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a workflow name must be a non-empty string without ':', got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
        raise TypeError(f"register_workflow({name!r}, {cls!r}): not a subclass of RolloutWorkflow")
    if name in _WORKFLOWS and _WORKFLOWS[name] is not cls:
        raise ValueError(f"workflow {name!r} is already registered as {_WORKFLOWS[name].__module__}."
                         f"{_WORKFLOWS[name].__qualname__}")
    _WORKFLOWS[name] = cls


def registered_workflows() -> List[str]:
    return sorted(_WORKFLOWS)


def import_object(path: str, what: str = "object") -> Any:
    """The object named by ``"package.module:Name"`` (``Name`` may be dotted: ``Outer.Inner``); errors name the
    path and the cause."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{what} {path!r} is not an import path; write it as 'package.module:Name'")
    mod_name, attr = path.split(":")
    try:
        obj = importlib.import_module(mod_name)
    except Exception as e:
        raise ImportError(f"{what} {path!r}: cannot import module {mod_name!r} ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{what} {path!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def workflow_class(name_or_path: str) -> Type[RolloutWorkflow]:
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"a workflow is a registered name or an import path 'package.module:Class', "
                         f"got {name_or_path!r}")
    if ":" in name_or_path:
        cls = import_object(name_or_path, "workflow")
        if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
            raise TypeError(f"workflow {name_or_path!r} is {cls!r}, not a subclass of "
                            "realhf.api.core.workflow_api.RolloutWorkflow (which defines arun_episode)")
        return cls
    if name_or_path not in _WORKFLOWS:
        hint = "" if _WORKFLOWS else " (none: import realhf.impl.workflow, where the built-in ones register)"
        raise ValueError(f"unknown workflow {name_or_path!r}; registered: {sorted(_WORKFLOWS)}{hint}, or give an "
                         "import path 'package.module:Class'")
    return _WORKFLOWS[name_or_path]


def make_workflow(name_or_path: str, **kwargs) -> RolloutWorkflow:
    """Build the workflow ``name_or_path`` (a registered name such as ``rlvr``/``multi_turn``, or
    ``"package.module:ClassName"``) with ``kwargs``; a wrong argument names the workflow. The built-in names exist
    once ``realhf.impl.workflow`` is imported."""
    cls = workflow_class(name_or_path)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"workflow {name_or_path!r} ({cls.__module__}.{cls.__qualname__}) cannot be built with "
                        f"arguments {sorted(kwargs)}: {e}") from e


# ---------------------------------------------------------------------------------------------------- data
def episode_data(dataset, index: int) -> Dict[str, Any]:
    """The ``data`` of an episode from item ``index`` of a math prompt dataset
    (``realhf.impl.dataset.math.MathPromptDataset``): ``{"query_id", "prompt" (the raw text), "input_ids" (the
    formatted, tokenized prompt), "solutions", "task"}``, plain Python values."""
    item = dataset[index]
    missing = [k for k in ("query_id", "prompt", "prompt_ids") if k not in item]
    if missing:
        raise KeyError(f"dataset item {index} of {type(dataset).__name__} lacks {missing}; episode_data needs a "
                       "prompt dataset item (query_id, prompt, prompt_ids[, solutions, task])")
    return {"query_id": str(item["query_id"]), "prompt": item["prompt"],
            "input_ids": [int(t) for t in item["prompt_ids"]], "solutions": list(item.get("solutions") or []),
            "task": item.get("task") or "math"}


RewardFn = Callable[[str, Dict[str, Any]], Any]  # (completion text, data) -> float, or an awaitable of one
