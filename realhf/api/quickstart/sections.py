"""The sections of the quickstart experiment configs (:mod:`realhf.api.quickstart.config`, which re-exports them):
run control, logging, micro-batches and MFC placement, models and datasets. Each checks its own fields in
``__post_init__``; the experiment configs check across sections."""
import dataclasses
from typing import List, Optional, Union

from realhf.api.core.config import OptimizerConfig
from realhf.api.core.dfg import MicroBatchSpec
from realhf.api.quickstart.options import check_choice, check_int, option

WANDB_MODES = ("disabled", "offline", "online")
DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass
class RunControl:
    """When to stop early. Every ``exp_ctrl`` option is the :class:`~realhf.api.core.system_api.ExperimentSpec`
    field of the same name. ``null`` frequencies mean never; several frequencies of one kind trigger on
    whichever comes first."""

    benchmark_steps: Optional[int] = option(None, "stop after N steps, e.g. for benchmarking (null = run all epochs)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name == "total_train_epochs":
                check_int(f.name, self.total_train_epochs, 1)
            else:
                check_int(f.name, getattr(self, f.name), 1, optional=True)


@dataclasses.dataclass
class ExperimentSaveControl(RunControl):
    """When a training run stops, saves and checkpoints for recovery."""

    total_train_epochs: int = option(1, "number of passes over the training data")
    save_freq_epochs: Optional[int] = option(None, "save a HF checkpoint every N epochs (null = never)")
    save_freq_steps: Optional[int] = option(None, "save a HF checkpoint every N steps (null = never)")
    save_freq_secs: Optional[int] = option(None, "save a HF checkpoint every N seconds (null = never)")
    ckpt_freq_epochs: Optional[int] = option(None, "write a recover checkpoint every N epochs (null = never)")
    ckpt_freq_steps: Optional[int] = option(None, "write a recover checkpoint every N steps (null = never)")
    ckpt_freq_secs: Optional[int] = option(None, "write a recover checkpoint every N seconds (null = never)")


@dataclasses.dataclass
class ExperimentSaveEvalControl(ExperimentSaveControl):
    """When a training run with a validation set stops, saves, checkpoints for recovery and evaluates."""

    eval_freq_epochs: Optional[int] = option(None, "evaluate on the validation set every N epochs (null = every "
                                                   "epoch when there is a validation set)")
    eval_freq_steps: Optional[int] = option(None, "evaluate on the validation set every N steps (null = never)")


@dataclasses.dataclass
class WandBConfig:
    """Weights & Biases logging."""

    mode: str = option("disabled", "disabled | offline | online")
    entity: Optional[str] = option(None, "wandb entity (team or user)")
    project: Optional[str] = option(None, "wandb project (default: the experiment name)")
    name: Optional[str] = option(None, "run name (default: the trial name)")
    group: Optional[str] = option(None, "run group")
    job_type: Optional[str] = option(None, "job type")
    notes: Optional[str] = option(None, "free-text notes")
    tags: Optional[List[str]] = option(None, "list of run tags")

    def __post_init__(self):
        check_choice("mode", self.mode, WANDB_MODES)


@dataclasses.dataclass
class TensorBoardConfig:
    """TensorBoard logging."""

    path: Optional[str] = option(None, "folder for TensorBoard event files (null = <run dir>/logs/tensorboard)")


@dataclasses.dataclass
class MicroBatchConfig:
    """How one MFC cuts its per-rank batch into micro-batches (see ``MicroBatchSpec``)."""

    n_mbs: int = option(1, "minimum number of micro-batches per rank")
    max_tokens_per_mb: Union[int, str] = option(
        "auto", "maximum tokens in one micro-batch (a longer single sample goes alone); auto: the whole per-rank batch "
                "where the memory plan says it fits the device, else the largest budget that fits (generation: the "
                "fewest micro-batches of prompts that fit)")

    def __post_init__(self):
        check_int("n_mbs", self.n_mbs, 1)
        v = self.max_tokens_per_mb
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"max_tokens_per_mb={v!r} is not allowed; expected an integer >= 1 or auto")

    def to_spec(self) -> MicroBatchSpec:
        """The spec; ``auto`` not yet resolved by the launcher's memory plan (``realhf.experiments.memory_plan``) means
        no budget."""
        tokens = 2**31 - 1 if self.max_tokens_per_mb == "auto" else self.max_tokens_per_mb
        return MicroBatchSpec(n_mbs=self.n_mbs, max_tokens_per_mb=tokens)


@dataclasses.dataclass
class MFCPlacement:
    """Where one MFC runs under ``allocation_mode=manual``."""

    device_mesh: str = option("", "allocation_mode=manual: this MFC's devices, e.g. 'localhost:0,1', 'node01:0-3' "
                                  "or 'node01;node02' (ids are worker slots on CPU)")
    parallel: str = option("", "allocation_mode=manual: this MFC's layout on its mesh, e.g. d2m1p1")


@dataclasses.dataclass
class MFCConfig(MFCPlacement):
    """Where one MFC of a model runs and how it cuts its batch into micro-batches."""

    mb_spec: MicroBatchConfig = option(help="micro-batching of this MFC", factory=MicroBatchConfig)


@dataclasses.dataclass
class ModelConfig:
    """A model loaded from a Hugging Face folder."""

    path: str = option("", "Hugging Face model folder (config.json + safetensors + tokenizer)")
    dtype: str = option("auto", "parameter dtype: auto (the runtime's default: bfloat16 on GPU, float32 on CPU) "
                                "| float32 | bfloat16")
    offload: bool = option(False, "keep this model's inference-only replicas (the reference model, the actor's "
                                  "generation layout) in host memory between their calls, freeing GPU memory")
    compile: bool = option(False, "run the transformer blocks' parts around attention (norms, projections, "
                                  "rotary, MLP) as torch.compile graphs in forward and backward passes (tp = 1; "
                                  "faster for small models, at a compile cost of seconds once per worker)")

    def __post_init__(self):
        check_choice("dtype", self.dtype, DTYPES)


@dataclasses.dataclass
class ModelTrainEvalConfig(ModelConfig):
    """A model that is trained (and evaluated)."""

    optimizer: OptimizerConfig = option(help="optimizer and learning-rate schedule", factory=OptimizerConfig)
    gradient_checkpointing: bool = option(False, "activation checkpointing: a training pass keeps only each block's "
                                                 "input and recomputes the block in the backward pass (about a third "
                                                 "more compute; activations per token fall from about 60 hidden "
                                                 "widths a block to one), for long sequences")


@dataclasses.dataclass
class PromptAnswerDatasetConfig:
    """JSONL rows ``{"prompt": str, "answer": str}`` for supervised fine-tuning."""

    train_path: str = option("", "training JSONL file")
    valid_path: Optional[str] = option(None, "validation JSONL file (null = no validation)")
    max_seqlen: int = option(1024, "prompt + answer tokens are truncated to this length")
    train_bs_n_seqs: int = option(16, "sequences per training step (global, over all data-parallel ranks)")
    valid_bs_n_seqs: int = option(16, "sequences per validation batch (global)")

    def __post_init__(self):
        check_int("max_seqlen", self.max_seqlen, 2)
        check_int("train_bs_n_seqs", self.train_bs_n_seqs, 1)
        check_int("valid_bs_n_seqs", self.valid_bs_n_seqs, 1)


@dataclasses.dataclass
class PromptOnlyDatasetConfig:
    """JSONL rows with a ``prompt`` (and for math, ``query_id`` + ``solutions``)."""

    path: str = option("", "prompt JSONL file")
    max_prompt_len: int = option(256, "prompts longer than this many tokens are skipped (with a warning)")
    train_bs_n_seqs: int = option(16, "prompts per step (global, over all data-parallel ranks)")

    def __post_init__(self):
        check_int("max_prompt_len", self.max_prompt_len, 1)
        check_int("train_bs_n_seqs", self.train_bs_n_seqs, 1)
