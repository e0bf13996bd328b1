"""User-facing experiment configs, the allocation-mode grammar and the quickstart CLI registry."""
from realhf.api.quickstart.allocation import (
    AllocationError,
    AllocationMode,
    heuristic_layout,
    is_generation_mfc,
    parse_allocation_mode,
)
from realhf.api.quickstart.config import (
    BaseExperimentConfig,
    ExperimentSaveEvalControl,
    GenConfig,
    GenerationExpConfig,
    MFCConfig,
    MicroBatchConfig,
    ModelConfig,
    ModelTrainEvalConfig,
    PPOHyperparameters,
    PPOMathConfig,
    PromptAnswerDatasetConfig,
    PromptOnlyDatasetConfig,
    SFTConfig,
    TensorBoardConfig,
    WandBConfig,
)
from realhf.api.quickstart.entry import (
    ConfigError,
    HelpRequested,
    config_to_yaml,
    load_config,
    main,
    parse_cli,
    register_quickstart_exp,
    registered_experiments,
)
