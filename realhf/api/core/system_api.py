"""What the runtime executes: an experiment turned into models, layouts, a dataset and a DFG.

An experiment (``realhf/experiments``) builds an :class:`ExperimentSpec` from its user config. The
launcher builds it once and ships it (pickled, beside the run's config file) to the master and every
worker, so it holds plain picklable values only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from realhf.api.core.config import OptimizerConfig
from realhf.api.core.dfg import MFCDef
from realhf.base.topology import ParallelDims


@dataclasses.dataclass
class GenServersSpec:
    """The generation servers that serve a model replica (a ``vllm.``/``sglang.``/``gen.`` allocation): one
    server process per data-parallel rank of the generation layout, each with ``tp`` tensor-parallel ranks
    (device slots ``first_slot + i * tp ...``), started by the launcher before the master and the workers."""

    backend: str  # gen | vllm | sglang
    n_servers: int
    tp: int = 1
    first_slot: int = 0  # the device slot of server 0's first rank (after the slots of everything else)
    dtype: str = "auto"  # auto: the runtime's default (bf16 on GPU, fp32 on CPU)
    max_model_len: int = 2048
    max_num_seqs: int = 64
    param_realloc: str = "disk"  # disk | memory: how trained weights reach the servers (the run's param_realloc)
    # the servers share GPUs with model workers (``gpus_per_node``): an in-memory weight update then goes by CUDA IPC
    # handles (weight_transport auto/shared) or through a gloo group (group), as NCCL cannot hold two ranks of one GPU
    shares_gpus: bool = False
    weight_transport: str = "auto"  # auto | group | shared: how param_realloc=memory moves them (gen_server option)
    routing: str = "least_requests"
    startup_timeout_secs: float = 600.0
    request_timeout_secs: float = 3600.0
    health_timeout_secs: float = 60.0  # a running server silent (or its engine stuck) this long stops the run
    cpus_per_worker: int = 1  # torch threads of a CPU server (the run's cpus_per_worker)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # backend options (e.g. vLLM engine args)


@dataclasses.dataclass
class ModelSpec:
    """One replica of a model role (``actor``, ``actor@1``, ...) held by a set of workers under one layout.

    A role whose MFCs use different layouts has one replica per layout; the replica that trains is
    ``<role>`` itself, and the others name it in ``realloc_from``: before they run, the master has the
    trained parameters reallocated onto them (``realhf.impl.model.parallelism.realloc``).
    """

    name: str
    path: str
    layout: ParallelDims
    ranks: List[int]  # model-worker ranks of its mesh, in grid order
    dtype: str = "auto"  # a torch dtype name, or auto: the worker's runtime default (bf16 on GPU, fp32 on CPU)
    is_critic: bool = False
    optimizer: Optional[OptimizerConfig] = None  # None: inference/generation only
    total_train_steps: int = 1
    tokenizer_path: Optional[str] = None
    realloc_from: Optional[str] = None  # the trained replica this one mirrors
    offload: bool = False  # keep the parameters in host memory between calls (inference-only replicas)
    compile: bool = False  # run the blocks' non-attention parts as compiled graphs (ReaLModel.compile_blocks)
    gradient_checkpointing: bool = False  # training passes recompute each block in backward (ReaLModel.checkpointing)
    # served by generation servers: this replica (on one worker, layout d1m1p1) holds no weights, only a client;
    # its ``realloc_from`` source publishes its weights to the servers instead of reallocating them
    gen_servers: Optional[GenServersSpec] = None

    @property
    def role(self) -> str:
        return self.name.partition("@")[0]

    def __post_init__(self):
        if len(self.ranks) != self.layout.world_size:
            raise ValueError(
                f"model {self.name!r}: layout {self.layout} needs {self.layout.world_size} workers, "
                f"got ranks {self.ranks}"
            )


@dataclasses.dataclass
class DatasetSpec:
    """A dataset loaded by the data-parallel heads of ``holder_model``'s layout (one shard each)."""

    kind: str  # registered dataset name
    args: Dict[str, Any]
    batch_size: int  # sequences per step, over all data-parallel ranks
    holder_model: str
    shuffle: bool = True


@dataclasses.dataclass
class RolloutSpec:
    """The rollout side of an asynchronous run (``async-ppo-math``): a rollout manager and ``n_workers`` rollout
    workers feed the trainer a stream of finished trajectories instead of a generation MFC.

    Staleness: the ``batch_size`` prompts trained at global step ``s`` (1-based) form *batch* ``s - 1``; a
    rollout for batch ``b`` may start only while ``b <= version + max_head_offpolicyness`` (``version``: the
    weight version the servers hold, = trained steps), and at most ``max_concurrent_rollouts`` run at once.
    Prompts follow the order a synchronous run would draw them in (``EpochIterator`` over ``n_prompts``
    samples with ``seed``/``shuffle``, dropping each epoch's last partial batch)."""

    n_workers: int
    batch_size: int  # prompts (episodes) per training step
    dp_size: int  # the trainer's data-parallel heads that pull trajectories
    total_batches: int  # training steps of the run
    n_prompts: int  # samples of the prompt dataset
    max_head_offpolicyness: int = 0
    max_concurrent_rollouts: int = 64
    dataset: Optional[DatasetSpec] = None  # the prompt dataset every rollout worker loads
    workflow: str = "rlvr"  # a registered workflow name or an import path "pkg.module:Class"
    workflow_args: Dict[str, Any] = dataclasses.field(default_factory=dict)  # plain JSON
    reward_fn: str = "realhf.impl.workflow.rewards:MathReward"  # import path of the reward class or async callable
    reward_args: Dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments of a reward class
    reward_output_scaling: float = 1.0  # every reward becomes (reward + bias) * scaling, as rw-math's
    reward_output_bias: float = 0.0
    gconfig: Dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingConfig fields, plus n (group size)
    tokenizer_path: str = ""
    dynamic_filtering: bool = False  # drop (and replace) groups whose rewards are all equal
    shuffle: bool = True
    seed: int = 1
    episode_timeout_secs: float = 3600.0
    max_episode_retries: int = 2  # retries of a prompt's failed episode (timeout, server lost) before the run stops
    weight_update: str = "interrupt"  # interrupt | inflight: what an update does to running answers (rollout_manager)
    max_seq_len: int = 0  # the servers' max_model_len: the workflow's sequence budget (0: not set)
    use_chat_template: bool = False  # the prompts are chat turns (a workflow that inserts turns follows suit)


@dataclasses.dataclass
class DynamicSamplingSpec:
    """DAPO's dynamic sampling in a synchronous run: once the MFCs that produce ``key`` (one value per answer) have run
    over a fetched batch, the master drops the samples whose values are all equal (a prompt whose answers all got
    one reward) and fetches and generates more batches until the batch is full again, at most ``max_rounds`` batches
    per step (then the batch is filled up with dropped samples)."""

    key: str = "rewards"
    max_rounds: int = 10


@dataclasses.dataclass
class ExperimentSpec:
    experiment_name: str
    trial_name: str
    n_workers: int
    models: List[ModelSpec]
    mfcs: List[MFCDef]
    dataset: DatasetSpec
    total_train_epochs: int
    seed: int
    log_dir: str
    save_dir: str
    recover_dir: str
    valid_dataset: Optional[DatasetSpec] = None
    # frequencies (None = never)
    save_freq_epochs: Optional[int] = None
    save_freq_steps: Optional[int] = None
    save_freq_secs: Optional[int] = None
    ckpt_freq_epochs: Optional[int] = None
    ckpt_freq_steps: Optional[int] = None
    ckpt_freq_secs: Optional[int] = None
    eval_freq_epochs: Optional[int] = None
    eval_freq_steps: Optional[int] = None
    benchmark_steps: Optional[int] = None
    cpus_per_worker: int = 1
    cpus_per_worker_max: int = 0  # > cpus_per_worker: model workers' threads follow idle host cores (cpu_share)
    worker_timeout_secs: float = 10.0
    param_realloc: str = "memory"  # memory | disk
    wandb: Optional[Dict[str, Any]] = None  # wandb.init arguments of the master's stats logger (None: off)
    tensorboard_dir: Optional[str] = None  # TensorBoard event files of the master's stats logger (None: <log_dir>/tensorboard)
    # a hook that runs on the master at the end (e.g. merging generated outputs); name of a function
    # registered by the experiment
    final_hook: Optional[str] = None
    # the checkpoint evaluator (realhf.api.quickstart.eval_config.EvaluatorConfig); None or disabled = off
    auto_eval: Optional[Any] = None
    # asynchronous RL: the rollout manager and workers that feed the trainer (None: a synchronous run)
    rollout: Optional[RolloutSpec] = None
    # synchronous runs: refill the batch after dropping samples without signal (None: off)
    dynamic_sampling: Optional[DynamicSamplingSpec] = None

    def device_slots(self) -> int:
        """Device slots the launcher provides: one per model worker, ``tp`` per generation server."""
        m = self.served()
        return self.n_workers + (m.gen_servers.n_servers * m.gen_servers.tp if m is not None else 0)

    def served(self) -> Optional[ModelSpec]:
        """The model replica served by generation servers, if any."""
        return next((m for m in self.models if m.gen_servers is not None), None)

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"no model named {name!r}; models: {[m.name for m in self.models]}")

    def __post_init__(self):
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        for m in self.models:
            bad = [r for r in m.ranks if not 0 <= r < self.n_workers]
            if bad:
                raise ValueError(f"model {m.name!r} uses worker ranks {bad} outside [0, {self.n_workers})")
        for mfc in self.mfcs:
            self.model(str(mfc.model_name))
        self.model(self.dataset.holder_model)
        for m in self.models:
            if m.offload and m.optimizer is not None:
                raise ValueError(f"model {m.name!r} trains and cannot be offloaded")
            if m.realloc_from is not None:
                src = self.model(m.realloc_from)
                if src.optimizer is None or m.optimizer is not None or src.role != m.role:
                    raise ValueError(f"model {m.name!r} mirrors {src.name!r}: the source must be the trained replica "
                                     "of the same role and the mirror must not train")
                if src.dtype != m.dtype or src.is_critic != m.is_critic:
                    raise ValueError(f"model {m.name!r} mirrors {src.name!r} but differs in dtype or head")
