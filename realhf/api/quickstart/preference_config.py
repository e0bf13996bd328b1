"""Options of the experiments that learn from preference pairs: ``rw`` (a reward model under the Bradley–Terry loss)
and ``dpo`` (Direct Preference Optimization against a frozen reference). Their data are JSONL rows
``{"prompt", "chosen", "rejected"}`` (``realhf.impl.dataset.preference``)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from realhf.api.quickstart.config import BaseExperimentConfig, _auto_eval_option, _require_dir, _require_file
from realhf.api.quickstart.eval_config import EvaluatorConfig
from realhf.api.quickstart.options import check_int, check_number, option
from realhf.api.quickstart.sections import (ExperimentSaveEvalControl, MFCConfig, MicroBatchConfig, ModelConfig,
                                            ModelTrainEvalConfig)

_PAIRS = "a JSONL file of {prompt, chosen, rejected} rows"


@dataclasses.dataclass
class PreferenceDatasetConfig:
    """JSONL rows ``{"prompt": str, "chosen": str, "rejected": str}`` (optional ``"id"``): for each prompt, the
    preferred answer and the other one."""

    train_path: str = option("", "training JSONL of preference pairs")
    valid_path: Optional[str] = option(None, "validation JSONL of preference pairs (null = no validation)")
    max_seqlen: int = option(1024, "prompt + answer tokens of each sequence (chosen and rejected alike) are truncated "
                                   "to this length")
    train_bs_n_seqs: int = option(16, "preference pairs per training step (global, over all data-parallel ranks); "
                                      "each pair is two sequences")
    valid_bs_n_seqs: int = option(16, "preference pairs per validation batch (global)")
    use_chat_template: bool = option(False, "wrap each prompt in the tokenizer's chat template as a user turn followed "
                                            "by the assistant header (as ppo-math's use_chat_template does); false: "
                                            "the prompt as written, with the tokenizer's special tokens")

    def __post_init__(self):
        check_int("max_seqlen", self.max_seqlen, 2)
        check_int("train_bs_n_seqs", self.train_bs_n_seqs, 1)
        check_int("valid_bs_n_seqs", self.valid_bs_n_seqs, 1)


@dataclasses.dataclass
class DPOHyperparameters:
    """Direct Preference Optimization (Rafailov et al. 2023)."""

    beta: float = option(0.1, "strength of the implicit KL constraint to the reference: the loss is "
                              "-log sigmoid(beta * log-ratio margin); larger keeps the policy closer to the reference")

    def __post_init__(self):
        check_number("beta", self.beta, lo=0, lo_open=True)


def _check_data_and_eval(cfg, train_mfc: str) -> None:
    """The dataset files and the evaluation cadence of a preference experiment (errors name the keys)."""
    _require_file("dataset.train_path", cfg.dataset.train_path, _PAIRS)
    _require_file("dataset.valid_path", cfg.dataset.valid_path, _PAIRS, optional=True)
    for key in ("eval_freq_epochs", "eval_freq_steps"):
        v = getattr(cfg.exp_ctrl, key)
        if v is not None and cfg.dataset.valid_path is None:
            raise ValueError(f"exp_ctrl.{key}={v} needs a validation set to evaluate on: set dataset.valid_path, "
                             f"or leave exp_ctrl.{key} null")
    cfg._check_bs("dataset.train_bs_n_seqs", cfg.dataset.train_bs_n_seqs, train_mfc, what="pair")
    if cfg.dataset.valid_path is not None:
        cfg._check_bs("dataset.valid_bs_n_seqs", cfg.dataset.valid_bs_n_seqs, train_mfc, what="pair")


@dataclasses.dataclass
class RWConfig(BaseExperimentConfig):
    """A reward model (the transformer with a scalar head) trained on preference pairs under the Bradley–Terry loss,
    saved as a Hugging Face folder (``score.weight``: ``*ForSequenceClassification``) that ppo-math takes as
    ``reward.model.path`` (``reward.type=model``)."""

    MFC_NAMES = ("trainDefault",)

    exp_ctrl: ExperimentSaveEvalControl = option(help="stopping, saving, recover checkpoints, evaluation",
                                                 factory=ExperimentSaveEvalControl)
    model: ModelTrainEvalConfig = option(
        help="the reward model to train: a causal language model (e.g. the SFT checkpoint; its LM head gives way to a "
             "fresh scalar head) or a reward model folder (its scalar head score.weight is trained on)",
        factory=ModelTrainEvalConfig)
    dataset: PreferenceDatasetConfig = option(help="preference pairs", factory=PreferenceDatasetConfig)
    mb_spec: MicroBatchConfig = option(help="micro-batching of the training step (a pair is never split)",
                                       factory=MicroBatchConfig)

    def __post_init__(self):
        super().__post_init__()
        _require_dir("model.path", self.model.path, "a Hugging Face model folder")
        if self.model.offload:
            raise ValueError("model.offload=True is not allowed for rw: only inference-only replicas are offloaded, "
                             "and the model trains at every step; set model.offload=false")
        _check_data_and_eval(self, "trainDefault")

    def mfc_names(self) -> List[str]:
        return list(self.MFC_NAMES)


@dataclasses.dataclass
class DPOConfig(BaseExperimentConfig):
    """Direct Preference Optimization of a policy against a frozen reference on preference pairs; the reference's
    log-probs come from ``ref_inf`` on its own layout."""

    MFC_NAMES = ("ref_inf", "actor_train")

    exp_ctrl: ExperimentSaveEvalControl = option(help="stopping, saving, recover checkpoints, evaluation",
                                                 factory=ExperimentSaveEvalControl)
    auto_eval: EvaluatorConfig = _auto_eval_option()
    actor: ModelTrainEvalConfig = option(help="the policy to train (e.g. the SFT checkpoint)", factory=ModelTrainEvalConfig)
    ref: ModelConfig = option(help="the frozen reference (path '' = actor.path)", factory=ModelConfig)
    dataset: PreferenceDatasetConfig = option(help="preference pairs", factory=PreferenceDatasetConfig)
    dpo: DPOHyperparameters = option(help="DPO hyperparameters", factory=DPOHyperparameters)
    actor_train: MFCConfig = option(help="the policy's training MFC", factory=MFCConfig)
    ref_inf: MFCConfig = option(help="the reference's log-prob MFC", factory=MFCConfig)

    def __post_init__(self):
        super().__post_init__()
        _require_dir("actor.path", self.actor.path, "a Hugging Face model folder")
        if self.ref.path:
            _require_dir("ref.path", self.ref.path, "a Hugging Face model folder")
        if self.actor.offload:
            raise ValueError("actor.offload=True is not allowed for dpo: only inference-only replicas are offloaded, "
                             "and the policy trains at every step; set actor.offload=false (ref.offload applies)")
        _check_data_and_eval(self, "actor_train")
        self._check_bs("dataset.train_bs_n_seqs", self.dataset.train_bs_n_seqs, "ref_inf", what="pair")

    def mfc_names(self) -> List[str]:
        return list(self.MFC_NAMES)

    def ref_path(self) -> str:
        return self.ref.path or self.actor.path
