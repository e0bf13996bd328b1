"""User-facing experiment configs of the quickstart CLI.

Every field carries ``metadata={"help": ...}`` (shown by ``--help``) and every dataclass checks its
values in ``__post_init__``, raising ``ValueError`` that names the key, the value and what is
allowed. Nested sections check only their own fields (their messages name the field; the CLI adds
the dotted path); cross-field checks live in the experiment configs and name full dotted keys.

Types are restricted to what OmegaConf structured configs support (str/int/float/bool, Optional,
nested dataclasses, lists of primitives); choices are plain strings checked in ``__post_init__``.

Required strings (model and dataset paths) default to ``""`` so that sections can be built with
defaults; the experiment config that needs them says so when they are empty.

Every option is read by the code it is for: an experiment has only the options it uses (``gen`` has no
checkpoint or evaluation options), and ``tests/unit/test_option_reach.py`` sets each option of each experiment
to a non-default value and checks that the value arrives where it is used. The sampling section is the generation
contract's (``realhf.api.core.generation``; ``ppo.gen`` in :mod:`realhf.api.quickstart.ppo_config`, with the PPO
section), the reward section is in :mod:`realhf.api.quickstart.reward_config`, the others in
:mod:`realhf.api.quickstart.sections` (re-exported here). A renamed option keeps its old name as a deprecated alias
(an experiment config's ``DEPRECATED_KEYS``: old dotted key -> new), which the loader maps with a warning.
"""
import dataclasses
import os
import re
from typing import List, Optional, Tuple, Union

from realhf.api.core.config import check_finite
from realhf.api.core.generation import GenerationHyperparameters
from realhf.api.quickstart.allocation import (
    AllocationError,
    AllocationMode,
    is_generation_mfc,
    parse_allocation_mode,
    parse_device_mesh,
)
from realhf.api.quickstart.eval_config import EvaluatorConfig
from realhf.api.quickstart.options import check_choice, check_int, check_number, option
from realhf.api.quickstart.sections import (  # noqa: F401 (the sections, re-exported)
    RunControl,
    ExperimentSaveControl,
    ExperimentSaveEvalControl,
    WandBConfig,
    TensorBoardConfig,
    MicroBatchConfig,
    MFCPlacement,
    MFCConfig,
    ModelConfig,
    ModelTrainEvalConfig,
    PromptAnswerDatasetConfig,
    PromptOnlyDatasetConfig,
)
from realhf.api.quickstart.slurm_config import SlurmConfig
from realhf.api.quickstart.ppo_config import GenConfig, PPOHyperparameters, SamplingConfig  # noqa: F401 (re-exported)
from realhf.api.quickstart.reward_config import RENAMED_REWARD_KEYS, RewardConfig
from realhf.api.quickstart.stand_ins import is_stand_in
from realhf.base import logging
from realhf.base.topology import ParallelDims

logger = logging.getLogger(__name__)

MODES = ("local", "ray", "slurm")
RECOVER_MODES = ("disabled", "auto", "resume")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _default_fileroot() -> str:
    return os.environ.get("REALHF_FILEROOT") or os.path.join("~", ".cache", "realhf", "experiments")


# ----------------------------------------------------------------------------- path checks
def _require_dir(key: str, path: str, what: str) -> None:
    if not path:
        raise ValueError(f"{key} is required: set {key}=<path to {what}>")
    if is_stand_in(path):  # planning for another cluster (realhf.api.quickstart.stand_ins)
        return
    p = os.path.expanduser(path)
    if not os.path.isdir(p):
        raise ValueError(f"{key}={path!r}: no such folder; expected {what}")


def _require_file(key: str, path: Optional[str], what: str, optional: bool = False) -> None:
    if optional and path is None:
        return
    if not path:
        raise ValueError(f"{key} is required: set {key}=<path to {what}>")
    if is_stand_in(path):
        return
    if not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"{key}={path!r}: no such file; expected {what}")


# ----------------------------------------------------------------------------- experiments
def _auto_eval_option():
    return option(help="evaluate each saved checkpoint in the background (evaluation/) and log <dataset>/<metric> to "
                       "stats.jsonl and TensorBoard", factory=EvaluatorConfig)


@dataclasses.dataclass
class BaseExperimentConfig:
    """Options shared by every quickstart experiment."""

    experiment_name: str = option("quickstart", "experiment name (letters, digits, '_', '-', '.')")
    trial_name: str = option("trial0", "trial name; one experiment may have several trials")
    mode: str = option("local", "launcher: local (processes on this machine) | ray (a Ray cluster; pip install "
                                "'realhf[ray]') | slurm (a Slurm cluster: the slurm.* options)")
    ray_address: str = option("", "mode=ray: the Ray cluster to join ('auto', or host:port of its head); empty "
                                  "starts a Ray instance on this machine for the run")
    ray_gpus_per_worker: float = option(0.0, "mode=ray: GPUs each model worker reserves (1 on GPU clusters)")
    fileroot: str = option(help="root folder of logs and checkpoints (default $REALHF_FILEROOT or "
                                "~/.cache/realhf/experiments)", factory=_default_fileroot)
    seed: int = option(1, "random seed")
    recover_mode: str = option("disabled", "disabled (start afresh) | auto (resume the recover checkpoint of this run, "
                                           "if any: written with the same options, not finished; relaunch after a "
                                           "failure) | resume (such a checkpoint must exist); a fresh start moves an "
                                           "earlier recover/ folder aside to recover.stale-<time>/")
    recover_retries: int = option(1, "times to relaunch after a failure when recover_mode is auto")
    slurm: SlurmConfig = option(help="mode=slurm: partition, account, time, GPUs, container, extra sbatch/srun flags",
                                factory=SlurmConfig)
    n_nodes: int = option(1, "number of nodes")
    n_devices_per_node: int = option(1, "devices per node: GPUs, or model worker processes on CPU")
    gpus_per_node: int = option(0, "mode=local on a GPU machine with fewer GPUs than n_devices_per_node: the node's "
                                   "device slots share its GPUs, slot s on GPU s % gpus_per_node (e.g. a small "
                                   "model's generation server beside its trainer on one GPU: allocation_mode="
                                   "gen.d1m1p1+d1m1p1, n_devices_per_node=2, gpus_per_node=1); model workers still "
                                   "need a GPU each; a vLLM or SGLang server must then be told to leave memory for the "
                                   "trainer (gen_server.extra); 0: one GPU per slot")
    device_memory_gib: float = option(0.0, "memory of one device in GiB, for the launcher's memory plan (a plan that "
                                           "cannot fit is refused before start; max_tokens_per_mb=auto budgets): a "
                                           "GPU's memory, or on CPU the host memory a node's processes share; 0: read "
                                           "it where the launcher runs (local runs), unknown otherwise "
                                           "($REALHF_DEVICE_MEMORY_GIB overrides it)")
    cpus_per_worker: int = option(1, "CPU threads of each worker process")
    cpus_per_worker_max: int = option(0, "CPU runs: a model worker takes up to this many threads while other "
                                         "processes leave the host's cores idle, and falls back to cpus_per_worker "
                                         "when they need them (checked every 0.25 s between model blocks; e.g. the "
                                         "trainer of an asynchronous run on one machine uses the generation "
                                         "server's core while it waits for weights); 0: cpus_per_worker always")
    allocation_mode: str = option("d1m1p1", "device allocation and parallel layouts, e.g. d2m1p1, "
                                            "'actor_gen:d2m1p1,*:d1m2p1', 'vllm.d2m1p1+d2m1p1', manual, heuristic, search "
                                            "(the execution-plan search chooses each MFC's devices and layout)")
    worker_timeout_secs: float = option(10.0, "seconds without a heartbeat before a worker is declared lost (and before "
                                              "the workers end a run whose master stopped sending heartbeats)")
    wandb: WandBConfig = option(help="Weights & Biases logging", factory=WandBConfig)
    tensorboard: TensorBoardConfig = option(help="TensorBoard logging", factory=TensorBoardConfig)

    def __post_init__(self):
        for key in ("experiment_name", "trial_name"):
            v = getattr(self, key)
            if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
                raise ValueError(f"{key}={v!r} is not allowed; use letters, digits, '_', '-' and '.', "
                                 "starting with a letter or digit")
        check_finite(self)  # every float option of every section, including ones added later
        check_choice("mode", self.mode, MODES)
        check_number("ray_gpus_per_worker", self.ray_gpus_per_worker, lo=0)
        check_choice("recover_mode", self.recover_mode, RECOVER_MODES)
        if not self.fileroot:
            raise ValueError("fileroot is empty; set fileroot=<folder for logs and checkpoints>")
        check_int("seed", self.seed, 0)
        check_int("recover_retries", self.recover_retries, 0)
        check_int("n_nodes", self.n_nodes, 1)
        check_int("n_devices_per_node", self.n_devices_per_node, 1)
        check_int("gpus_per_node", self.gpus_per_node, 0)
        check_number("device_memory_gib", self.device_memory_gib, lo=0)
        if self.gpus_per_node > self.n_devices_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} is above n_devices_per_node={self.n_devices_per_node}"
                             ": each device slot uses one GPU, so at most n_devices_per_node GPUs are used; set it to "
                             "0 (one GPU per slot) or lower it")
        if self.gpus_per_node and self.mode != "local":
            raise ValueError(f"gpus_per_node={self.gpus_per_node} applies to mode=local; with mode={self.mode} each job "
                             "gets the GPUs it reserves (under Ray a fraction of a GPU: ray_gpus_per_worker=0.5)")
        check_int("cpus_per_worker", self.cpus_per_worker, 1)
        check_int("cpus_per_worker_max", self.cpus_per_worker_max, 0)
        if 0 < self.cpus_per_worker_max < self.cpus_per_worker:
            raise ValueError(f"cpus_per_worker_max={self.cpus_per_worker_max} is below cpus_per_worker="
                             f"{self.cpus_per_worker}; set it to 0 (off) or to at least cpus_per_worker")
        check_number("worker_timeout_secs", self.worker_timeout_secs, lo=0, lo_open=True)
        self.allocation()  # validates the grammar, MFC names and device counts

    # --------------------------------------------------------------- derived values
    # Options that do not change what a run computes (where it runs, how it is watched, logged, saved and
    # relaunched): a recover checkpoint written under other values of these still belongs to the run.
    RESUME_NEUTRAL_KEYS = ("mode", "ray_address", "ray_gpus_per_worker", "gpus_per_node", "device_memory_gib", "slurm", "fileroot", "recover_mode",
                           "recover_retries", "cpus_per_worker", "cpus_per_worker_max", "worker_timeout_secs",
                           "gen_server.health_timeout_secs", "wandb", "tensorboard",
                           "auto_eval", "exp_ctrl.save_freq_epochs", "exp_ctrl.save_freq_steps",
                           "exp_ctrl.save_freq_secs", "exp_ctrl.ckpt_freq_epochs", "exp_ctrl.ckpt_freq_steps",
                           "exp_ctrl.ckpt_freq_secs", "exp_ctrl.eval_freq_epochs", "exp_ctrl.eval_freq_steps")

    def resume_options(self) -> dict:
        """The options that shape the training (every option but :attr:`RESUME_NEUTRAL_KEYS`), as dotted keys."""
        flat = {}

        def walk(obj, prefix):
            for f in dataclasses.fields(obj):
                key, v = prefix + f.name, getattr(obj, f.name)
                # micro-batch budgets (set by hand, or by the launcher's memory plan for auto) cut the same
                # computation differently: a run may resume under others
                if not f.init or key in self.RESUME_NEUTRAL_KEYS or key.endswith("mb_spec") \
                        or key == "gen_server.max_num_seqs":  # (not f.init: set by the experiment, not an option)
                    continue
                if dataclasses.is_dataclass(v):
                    walk(v, key + ".")
                else:
                    flat[key] = list(v) if isinstance(v, (list, tuple)) else v

        walk(self, "")
        return flat

    def fingerprint(self) -> str:
        """A hash of :meth:`resume_options`: equal for two configs whose runs compute the same thing."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.resume_options(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def n_devices(self) -> int:
        """All device slots of the experiment (``n_nodes * n_devices_per_node``)."""
        return self.n_nodes * self.n_devices_per_node

    def mfc_names(self) -> Optional[List[str]]:
        """The experiment's MFC names (for allocation checks); None = not known here."""
        return None

    def allocation(self) -> AllocationMode:
        """The parsed, validated ``allocation_mode`` (``heuristic`` resolved for ``n_devices``). Parsed once per value
        of the fields it reads (``allocation_mode``, ``n_nodes``, ``n_devices_per_node``, the MFC names): later calls
        return the same object (read it, do not change it); a config changed since is parsed again."""
        names = self.mfc_names()
        key = (self.allocation_mode, self.n_nodes, self.n_devices_per_node, None if names is None else tuple(names))
        memo = self.__dict__.get("_allocation_memo")
        if memo is not None and memo[0] == key:
            return memo[1]
        try:
            mode = parse_allocation_mode(self.allocation_mode, names, self.n_devices)
        except AllocationError as e:
            raise ValueError(f"allocation_mode={self.allocation_mode!r} is not valid: {e}") from None
        mode = mode.resolve_heuristic(self.n_devices)
        self.__dict__["_allocation_memo"] = (key, mode)  # not a field: no option, not in the YAML or the fingerprint
        return mode

    def _dp_of(self, mfc_name: str) -> Optional[int]:
        """The MFC's data-parallel size, or None where the allocation does not give its layout (yet): a manual one
        without it, or ``search`` before the launcher's search."""
        if self.allocation().kind == "search":
            return None
        if self.allocation().kind == "manual":
            mc = getattr(self, mfc_name, None)
            if not (isinstance(mc, MFCPlacement) and mc.parallel):
                return None
        return self.mfc_allocation(mfc_name)[0].dp

    def mfc_allocation(self, mfc_name: str) -> Tuple[ParallelDims, Tuple[int, ...]]:
        """(layout, device slots) of one MFC. Device slots are model-worker ranks: on CPU one worker
        process per slot, on GPU node-major GPU ids. Smaller layouts use the first slots; decoupled
        generation MFCs use the slots after the rest's; ``manual`` reads ``<mfc>.device_mesh`` and
        ``<mfc>.parallel``."""
        mode = self.allocation()
        if mode.kind == "search":
            raise ValueError("allocation_mode=search is turned into a manual allocation by the launcher's plan search "
                             "before the experiment is built (python -m realhf.apps.quickstart, or "
                             "python -m realhf.apps.plan ... --search --write plan.yaml)")
        if mode.kind == "manual":
            mc = getattr(self, mfc_name, None)
            if not isinstance(mc, MFCPlacement):
                raise ValueError(f"allocation_mode=manual is not supported for MFC {mfc_name!r} of this experiment")
            if not mc.device_mesh or not mc.parallel:
                raise ValueError(f"allocation_mode=manual needs {mfc_name}.device_mesh (e.g. 'localhost:0,1') and "
                                 f"{mfc_name}.parallel (e.g. d2m1p1); got device_mesh={mc.device_mesh!r}, "
                                 f"parallel={mc.parallel!r}")
            try:
                ranks = parse_device_mesh(mc.device_mesh, self.n_nodes, self.n_devices_per_node)
            except AllocationError as e:
                raise ValueError(f"{mfc_name}.device_mesh={mc.device_mesh!r} is not valid: {e}") from None
            try:
                layout = ParallelDims.parse(mc.parallel)
            except ValueError as e:
                raise ValueError(f"{mfc_name}.parallel={mc.parallel!r} is not valid: {e}") from None
            if layout.world_size != len(ranks):
                raise ValueError(f"{mfc_name}.parallel={mc.parallel!r} needs {layout.world_size} devices, but "
                                 f"{mfc_name}.device_mesh={mc.device_mesh!r} has {len(ranks)}; they must match")
            return layout, tuple(ranks)
        layout = mode.layout_of(mfc_name)
        start = mode.rest_n_devices() if mode.kind == "decoupled" and is_generation_mfc(mfc_name) else 0
        return layout, tuple(range(start, start + layout.world_size))

    def _check_bs(self, bs_key: str, bs: int, mfc_name: str, per_rank: int = 1, what: str = "sequence") -> None:
        dp = self._dp_of(mfc_name)
        if dp is not None and bs < dp * per_rank:
            need = f"{per_rank} {what}s" if per_rank > 1 else f"one {what}"
            raise ValueError(
                f"{bs_key}={bs} is too small for MFC {mfc_name!r}, which has data-parallel size {dp} under "
                f"allocation_mode={self.allocation_mode!r}: every data-parallel rank needs at least {need} "
                f"per step, so {bs_key} must be >= {dp * per_rank} (or lower the 'd' of that layout)"
            )

    def wandb_init_kwargs(self) -> Optional[dict]:
        """Arguments of ``wandb.init`` for the master's stats logger, or None when wandb is disabled.
        Offline mode writes the run under ``<log_dir>/wandb`` and needs no network."""
        w = self.wandb
        if w.mode == "disabled":
            return None
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError(f"wandb.mode={w.mode!r} needs the wandb package: pip install 'realhf[wandb]' "
                             "(or set wandb.mode=disabled)") from None
        kw = dict(mode=w.mode, entity=w.entity, project=w.project or self.experiment_name,
                  name=w.name or self.trial_name, group=w.group, job_type=w.job_type, notes=w.notes,
                  tags=list(w.tags) if w.tags else None, dir=self.log_dir())
        return {k: v for k, v in kw.items() if v is not None}

    def tensorboard_dir(self) -> str:
        """The folder of the TensorBoard event files (``tensorboard.path``, by default under the logs)."""
        p = self.tensorboard.path
        return os.path.abspath(os.path.expanduser(p)) if p else os.path.join(self.log_dir(), "tensorboard")

    def run_dir(self) -> str:
        return os.path.join(os.path.abspath(os.path.expanduser(self.fileroot)), self.experiment_name, self.trial_name)

    def log_dir(self) -> str:
        return os.path.join(self.run_dir(), "logs")

    def ckpt_dir(self) -> str:
        return os.path.join(self.run_dir(), "checkpoints")

    def recover_dir(self) -> str:
        return os.path.join(self.run_dir(), "recover")


@dataclasses.dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on prompt/answer pairs (loss on answer tokens)."""

    MFC_NAMES = ("trainDefault",)

    exp_ctrl: ExperimentSaveEvalControl = option(help="stopping, saving, recover checkpoints, evaluation",
                                                 factory=ExperimentSaveEvalControl)
    auto_eval: EvaluatorConfig = _auto_eval_option()
    model: ModelTrainEvalConfig = option(help="the model to fine-tune", factory=ModelTrainEvalConfig)
    dataset: PromptAnswerDatasetConfig = option(help="training and validation data", factory=PromptAnswerDatasetConfig)
    mb_spec: MicroBatchConfig = option(help="micro-batching of the training step", factory=MicroBatchConfig)

    def __post_init__(self):
        super().__post_init__()
        _require_dir("model.path", self.model.path, "a Hugging Face model folder")
        if self.model.offload:
            raise ValueError("model.offload=True is not allowed for sft: only inference-only replicas are offloaded, "
                             "and the model trains at every step; set model.offload=false")
        _require_file("dataset.train_path", self.dataset.train_path, "a JSONL file of {prompt, answer} rows")
        _require_file("dataset.valid_path", self.dataset.valid_path, "a JSONL file of {prompt, answer} rows",
                      optional=True)
        for key in ("eval_freq_epochs", "eval_freq_steps"):
            v = getattr(self.exp_ctrl, key)
            if v is not None and self.dataset.valid_path is None:
                raise ValueError(f"exp_ctrl.{key}={v} needs a validation set to evaluate on: set dataset.valid_path, "
                                 f"or leave exp_ctrl.{key} null")
        self._check_bs("dataset.train_bs_n_seqs", self.dataset.train_bs_n_seqs, "trainDefault")
        if self.dataset.valid_path is not None:
            self._check_bs("dataset.valid_bs_n_seqs", self.dataset.valid_bs_n_seqs, "trainDefault")

    def mfc_names(self) -> List[str]:
        return list(self.MFC_NAMES)


@dataclasses.dataclass
class GenServerConfig:
    """Generation servers of a ``vllm.``/``sglang.``/``gen.`` allocation (one per data-parallel rank of its layout)."""

    max_num_seqs: Union[int, str] = option(
        "auto", "samples a server decodes together at most (more wait for a free slot); auto: as many as the run can "
                "have in flight on one server (prompts per step, or async_rl.max_concurrent_rollouts, times "
                "group_size, over the servers) and the memory plan says its device holds")
    routing: str = option("least_requests", "which server a request goes to: round_robin | least_requests | "
                                            "least_tokens (the samples of one prompt stay together)")
    startup_timeout_secs: float = option(600.0, "time the servers get to load the model and serve, before training")
    request_timeout_secs: float = option(3600.0, "time limit of one generation request")
    health_timeout_secs: float = option(60.0, "a running server that answers no /health for this many seconds, or "
                                              "whose engine has work but makes no progress for as long, stops the "
                                              "run, named (the launcher checks every second)")
    weight_transport: str = option(
        "auto", "how trained weights reach the servers with param_realloc=memory: group (broadcast over a "
                "torch.distributed group: NCCL between GPUs, gloo on CPU or where a server shares the trainer's GPU) | "
                "shared (by reference on the trainer's host: CUDA IPC handles on a GPU, nothing through host memory; "
                "a shared-memory file on CPU; gen. and vllm. servers) | auto (shared where every server takes shared "
                "weights, runs on the trainer's host and sees its GPU, else group)")
    extra: str = option("{}", "backend options as a JSON object, e.g. vLLM engine args "
                              "'{\"enable_prefix_caching\": true}'")

    def __post_init__(self):
        import json

        if self.max_num_seqs != "auto":
            check_int("gen_server.max_num_seqs", self.max_num_seqs, 1)
        check_choice("gen_server.routing", self.routing, ("round_robin", "least_requests", "least_tokens"))
        check_choice("gen_server.weight_transport", self.weight_transport, ("auto", "group", "shared"))
        check_number("gen_server.startup_timeout_secs", self.startup_timeout_secs, lo=0, lo_open=True)
        check_number("gen_server.request_timeout_secs", self.request_timeout_secs, lo=0, lo_open=True)
        check_number("gen_server.health_timeout_secs", self.health_timeout_secs, lo=0, lo_open=True)
        try:
            ok = isinstance(json.loads(self.extra), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"gen_server.extra must be a JSON object, got {self.extra!r}")

    def extra_dict(self) -> dict:
        import json

        return json.loads(self.extra)

    def check_weight_transport(self, param_realloc: Optional[str], fix: str = "leave it auto"):
        """A weight transport other than ``auto`` only where trained weights move in memory (``param_realloc``
        ``memory``; None: the experiment trains nothing)."""
        if self.weight_transport != "auto" and param_realloc != "memory":
            why = "this experiment trains no weights" if param_realloc is None else f"param_realloc={param_realloc}"
            raise ValueError(f"gen_server.weight_transport={self.weight_transport} says how trained weights move in "
                             f"memory; it has no use here ({why}): {fix}")


@dataclasses.dataclass
class GenerationExpConfig(BaseExperimentConfig):
    """Generate answers for a prompt file and write them as JSONL."""

    MFC_NAMES = ("gen",)

    exp_ctrl: RunControl = option(help="stopping early (gen saves no checkpoints)", factory=RunControl)
    model: ModelConfig = option(help="the model that generates", factory=ModelConfig)
    dataset: PromptOnlyDatasetConfig = option(help="prompts", factory=PromptOnlyDatasetConfig)
    gen: GenerationHyperparameters = option(help="sampling options", factory=GenerationHyperparameters)
    mb_spec: MicroBatchConfig = option(help="micro-batching of generation (max_tokens_per_mb counts prompt tokens)",
                                       factory=MicroBatchConfig)
    output_file: Optional[str] = option(None, "output JSONL (null = <log_dir>/generated.jsonl)")
    gen_server: GenServerConfig = option(help="generation servers of a decoupled allocation (vllm./sglang./gen.)",
                                         factory=GenServerConfig)
    use_chat_template: bool = option(True, "wrap each prompt in the tokenizer's chat template")

    def __post_init__(self):
        super().__post_init__()
        _require_dir("model.path", self.model.path, "a Hugging Face model folder")
        _require_file("dataset.path", self.dataset.path, "a JSONL file of {prompt} rows")
        self._check_bs("dataset.train_bs_n_seqs", self.dataset.train_bs_n_seqs, "gen", what="prompt")
        self.gen_server.check_weight_transport(None)

    def mfc_names(self) -> List[str]:
        return list(self.MFC_NAMES)

    def output_path(self) -> str:
        return os.path.expanduser(self.output_file) if self.output_file else os.path.join(self.log_dir(), "generated.jsonl")


@dataclasses.dataclass
class PPOMathConfig(BaseExperimentConfig):
    """PPO (or GRPO with use_critic=false) on math prompts with a rule-based correctness reward."""

    DEPRECATED_KEYS = RENAMED_REWARD_KEYS  # old option names the loader maps to their new ones, with a warning
    decoupled_loss = False  # class attribute, not an option: True where samples may come from older weights (async)
    param_realloc: str = option("memory", "how parameters move between the layouts of one model (e.g. actor_train -> "
                                          "actor_gen) or reach generation servers: memory (point-to-point, or a "
                                          "weight group with the servers) | disk (through a checkpoint)")
    exp_ctrl: ExperimentSaveControl = option(help="stopping, saving, recover checkpoints",
                                             factory=ExperimentSaveControl)
    auto_eval: EvaluatorConfig = _auto_eval_option()
    gen_server: GenServerConfig = option(help="generation servers of a decoupled allocation (vllm./sglang./gen.)",
                                         factory=GenServerConfig)
    actor: ModelTrainEvalConfig = option(help="the policy", factory=ModelTrainEvalConfig)
    critic: ModelTrainEvalConfig = option(help="the value model, loaded with a value head [hidden -> 1] instead of the "
                                               "LM head (path '' = initialise from actor.path)",
                                          factory=ModelTrainEvalConfig)
    ref: ModelConfig = option(help="the KL reference model (path '' = actor.path)", factory=ModelConfig)
    use_critic: bool = option(True, "train a critic (PPO with GAE); false = critic-free (GRPO-style)")
    dataset: PromptOnlyDatasetConfig = option(help="math prompts {query_id, prompt, solutions}",
                                              factory=PromptOnlyDatasetConfig)
    use_chat_template: bool = option(True, "wrap each prompt in the tokenizer's chat template")
    prompt_template: str = option("{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.",
                                  "text around each prompt before the chat template; '{prompt}' is replaced")
    group_size: int = option(1, "answers generated per prompt")
    ppo: PPOHyperparameters = option(help="PPO hyperparameters", factory=PPOHyperparameters)
    actor_gen: MFCConfig = option(help="actor generation MFC", factory=MFCConfig)
    actor_train: MFCConfig = option(help="actor training MFC", factory=MFCConfig)
    ref_inf: MFCConfig = option(help="reference log-prob MFC", factory=MFCConfig)
    rew_inf: MFCConfig = option(help="reward MFC: the grader scores whole batches (no micro-batches); a reward model "
                                     "(reward.type=model) runs with this layout and micro-batches", factory=MFCConfig)
    critic_inf: MFCConfig = option(help="critic value MFC", factory=MFCConfig)
    critic_train: MFCConfig = option(help="critic training MFC", factory=MFCConfig)
    reward: RewardConfig = option(help="how answers are scored (rew_inf; the rollout workflows' reward)",
                                  factory=RewardConfig)

    def __post_init__(self):
        super().__post_init__()
        check_choice("param_realloc", self.param_realloc, ("memory", "disk"))
        self.gen_server.check_weight_transport(self.param_realloc, "leave it auto, or set param_realloc=memory")
        _require_dir("actor.path", self.actor.path, "a Hugging Face model folder")
        if self.use_critic and self.critic.path:
            _require_dir("critic.path", self.critic.path, "a Hugging Face model folder")
        if self.use_ref() and self.ref.path:
            _require_dir("ref.path", self.ref.path, "a Hugging Face model folder")
        _require_file("dataset.path", self.dataset.path, "a JSONL file of {query_id, prompt, solutions} rows")
        check_int("group_size", self.group_size, 1)
        if self.ppo.group_adv_norm and self.group_size < 2:
            raise ValueError("ppo.group_adv_norm=True needs group_size >= 2 (a group of one has no spread); "
                             f"got group_size={self.group_size}")
        if self.ppo.behav_imp_weight_cap is not None and not self.decoupled_loss:
            raise ValueError(f"ppo.behav_imp_weight_cap={self.ppo.behav_imp_weight_cap!r} has no use in ppo-math: its "
                             "samples come from the trained weights (it caps the decoupled loss of async-ppo-math)")
        self._check_reward_model()
        bs = self.dataset.train_bs_n_seqs
        self._check_bs("dataset.train_bs_n_seqs", bs, "actor_gen", what="prompt")
        n_seqs = bs * self.group_size
        key = "dataset.train_bs_n_seqs * group_size"
        for name in self.mfc_names():
            if name == "actor_gen":
                continue
            per_rank = self.ppo.ppo_n_minibatches if name.endswith("_train") else 1
            self._check_bs(key, n_seqs, name, per_rank=per_rank)

    def _check_reward_model(self) -> None:
        """reward.type against the options it makes unused; a reward model scores in rew_inf (the rollout workers of
        async-ppo-math score with async_rl.reward_fn), with rew_inf's micro-batches."""
        r = self.reward
        if r.type == "grader":  # the reward model's options
            unused = [(f"reward.model.{f.name}", getattr(r.model, f.name), f.default) for f in dataclasses.fields(r.model)]
            unused += [(f"rew_inf.mb_spec.{f.name}", getattr(self.rew_inf.mb_spec, f.name), f.default)
                       for f in dataclasses.fields(MicroBatchConfig)]
        elif r.type == "model":  # the grader's options
            unused = [(f"reward.{f.name}", getattr(r, f.name), f.default) for f in dataclasses.fields(r)
                      if f.name in r.grader_args()]
        else:
            unused = []
        for key, value, default in unused:
            if value != default:
                why = ("the grader scores whole batches with no model; set reward.type=model (or model+grader) to "
                       "score with a reward model" if r.type == "grader" else
                       "the reward model scores alone; reward.type=model+grader adds the grader's grade")
                raise ValueError(f"{key}={value!r} has no use with reward.type={r.type}: {why}")
        if r.uses_model() and "rew_inf" not in self.mfc_names():
            raise ValueError(f"reward.type={r.type} scores in the rew_inf MFC, which this experiment does not have "
                             "(its rollout workers score with async_rl.reward_fn); use reward.type=grader")
        if r.uses_model() and not r.model.path:
            raise ValueError(f"reward.model.path is required with reward.type={r.type}: set reward.model.path=<the "
                             "reward model's Hugging Face folder, e.g. a checkpoint of the rw experiment>")

    def use_ref(self) -> bool:
        """A reference model is needed when a KL term is on."""
        return self.ppo.kl_ctl > 0 or self.ppo.kl_loss_coef > 0

    def mfc_names(self) -> List[str]:
        names = ["actor_gen", "rew_inf"]
        if self.use_ref():
            names.append("ref_inf")
        if self.use_critic:
            names += ["critic_inf", "critic_train"]
        names.append("actor_train")
        return names

    def ref_path(self) -> str:
        return self.ref.path or self.actor.path

    def critic_path(self) -> str:
        return self.critic.path or self.actor.path
