"""Sampling and PPO options: the sections the generating and PPO interfaces take as they are.

``gen.*`` of the ``gen`` experiment is a :class:`GenConfig`; ``ppo.*`` of ``ppo-math`` is a
:class:`PPOHyperparameters` whose ``gen`` is a :class:`SamplingConfig` (the answers per prompt are the
experiment's ``group_size``). The interfaces (``realhf.impl.model.interface``) receive these objects from
the experiment, so an option added here reaches them without being copied by hand.
"""
import dataclasses
from typing import List, Optional

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.quickstart.options import check_int, check_number, option


@dataclasses.dataclass
class SamplingConfig:
    """How answers are sampled. :meth:`to_hyperparameters` builds the engine's ``GenerationHyperparameters``
    from it (the one place where the two meet)."""

    max_new_tokens: int = option(256, "maximum generated tokens per answer")
    min_new_tokens: int = option(0, "minimum generated tokens before EOS may be sampled")
    greedy: bool = option(False, "greedy decoding instead of sampling")
    temperature: float = option(1.0, "sampling temperature, >= 1e-30 unless greedy (smaller ones overflow the scaled "
                                "logits in fp32; far below 1e-4 sampling is greedy in all but name)")
    top_p: float = option(1.0, "nucleus sampling probability mass, in (0, 1]")
    top_k: int = option(0, "sample among the k most likely tokens (0 = no limit)")
    stop_token_ids: List[int] = option(help="extra token ids that end an answer (EOS always does)", factory=list)
    seed: Optional[int] = option(None, "sampling seed (null = derived from the experiment seed)")
    compile_decode: bool = option(
        False, "compile the decode step with torch.compile (single-stage tp=1 generation; faster for small "
        "models, at a compile cost of seconds to minutes once per run)")
    cuda_graph: bool = option(
        True, "on CUDA, replay the decode step as a CUDA graph (single-stage tp=1 generation; the step's ~1,000 kernel "
        "launches become one); ignored on CPU")
    kv_cache_dtype: str = option(
        "auto", "the KV cache's dtype: auto (the model's) or float16 (an fp32 model on CPU reads half the bytes in "
        "attention over the cache; log-probs then differ from an fp32 forward by fp16 rounding, about 1e-3)")

    def __post_init__(self):
        self.to_hyperparameters()  # its checks (realhf.api.core.sampling_checks) name the fields

    def to_hyperparameters(self, n: int = 1) -> GenerationHyperparameters:
        """The engine's options for ``n`` answers per prompt."""
        return GenerationHyperparameters(
            max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens, greedy=self.greedy,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop_token_ids=tuple(self.stop_token_ids), n=n, seed=self.seed, compile_decode=self.compile_decode,
            cuda_graph=self.cuda_graph, kv_cache_dtype=self.kv_cache_dtype,
        )


@dataclasses.dataclass
class GenConfig(SamplingConfig):
    """Sampling options of the ``gen`` experiment, with the number of answers per prompt."""

    n: int = option(1, "samples per prompt")

    def to_hyperparameters(self, n: Optional[int] = None) -> GenerationHyperparameters:
        return super().to_hyperparameters(self.n if n is None else n)


@dataclasses.dataclass
class PPOHyperparameters:
    """PPO / GRPO algorithm options."""

    gen: SamplingConfig = option(help="sampling options of actor_gen (group_size answers per prompt)",
                                 factory=SamplingConfig)
    ppo_n_minibatches: int = option(4, "PPO minibatches (optimizer steps) per training step")
    kl_ctl: float = option(0.1, "coefficient of the KL penalty added to the reward (0 = none)")
    kl_loss_coef: float = option(0.0, "coefficient of KL(actor || ref) as a loss term (0 = none)")
    discount: float = option(1.0, "reward discount factor gamma, in [0, 1]")
    gae_lambda: float = option(1.0, "GAE lambda, in [0, 1]")
    eps_clip: float = option(0.2, "PPO ratio clip epsilon (> 0)")
    c_clip: Optional[float] = option(None, "dual-clip constant (> 1; null = no dual clip)")
    value_eps_clip: float = option(0.2, "value clip epsilon (> 0)")
    max_reward_clip: float = option(20.0, "rewards are clipped to [-max_reward_clip, max_reward_clip]")
    reward_output_scaling: float = option(1.0, "reward = (raw + reward_output_bias) * reward_output_scaling")
    reward_output_bias: float = option(0.0, "added to the raw reward before scaling")
    value_norm: bool = option(True, "normalise value targets with running statistics")
    entropy_coef: float = option(0.0, "entropy bonus coefficient (>= 0)")
    mask_too_long: bool = option(False, "drop answers cut at max_new_tokens from the loss")
    adv_norm: bool = option(True, "normalise advantages over the batch")
    group_adv_norm: bool = option(False, "normalise advantages within each prompt's group (GRPO)")
    skip_zero_advantage: bool = option(
        False, "actor_train runs only on answers whose advantage is nonzero at some token (GRPO: the groups whose "
        "rewards differ); the others give no policy gradient, so this saves their forward and backward passes. The "
        "loss becomes a token mean over the kept answers, and a step where no answer has a nonzero advantage makes "
        "no update. Needs kl_loss_coef=0 and entropy_coef=0 (those terms train every answer)")
    behav_imp_weight_cap: Optional[float] = option(
        None, "decoupled PPO (async-ppo-math): tokens whose behaviour importance weight exp(proximal - behaviour "
        "log-prob) exceeds this cap leave the loss (null = no cap; > 1)")

    def __post_init__(self):
        check_int("ppo_n_minibatches", self.ppo_n_minibatches, 1)
        check_number("kl_ctl", self.kl_ctl, lo=0)
        check_number("kl_loss_coef", self.kl_loss_coef, lo=0)
        check_number("discount", self.discount, lo=0, hi=1)
        check_number("gae_lambda", self.gae_lambda, lo=0, hi=1)
        check_number("eps_clip", self.eps_clip, lo=0, lo_open=True)
        if self.c_clip is not None:
            check_number("c_clip", self.c_clip, lo=1, lo_open=True)
        check_number("value_eps_clip", self.value_eps_clip, lo=0, lo_open=True)
        check_number("max_reward_clip", self.max_reward_clip, lo=0, lo_open=True)
        check_number("reward_output_scaling", self.reward_output_scaling)
        check_number("reward_output_bias", self.reward_output_bias)
        check_number("entropy_coef", self.entropy_coef, lo=0)
        if self.skip_zero_advantage and (self.kl_loss_coef > 0 or self.entropy_coef > 0):
            raise ValueError(f"ppo.skip_zero_advantage=true needs ppo.kl_loss_coef=0 and ppo.entropy_coef=0 (got "
                             f"{self.kl_loss_coef} and {self.entropy_coef}): those loss terms train every answer, "
                             f"whatever its advantage")
        if self.behav_imp_weight_cap is not None:
            check_number("behav_imp_weight_cap", self.behav_imp_weight_cap, lo=1, lo_open=True)
