"""Sampling and PPO options: the sections the generating and PPO interfaces take as they are.

The sampling section is the generation contract's :class:`~realhf.api.core.generation.GenerationHyperparameters`
(``realhf.api.core.generation``), the one set of sampling options of every generator: ``gen.*`` of the ``gen``
experiment is one; ``ppo.*`` of ``ppo-math`` is a :class:`PPOHyperparameters` whose ``gen`` is a
:class:`SamplingConfig`, the same section without ``n`` (the answers per prompt are the experiment's
``group_size``). The interfaces (``realhf.impl.model.interface``) receive these objects from the experiment, so an
option added to the contract reaches them without being copied by hand.
"""
import dataclasses
from typing import Optional

from realhf.api.core.generation import GenerationHyperparameters
from realhf.api.quickstart.options import check_choice, check_int, check_number, option

# the choices of the algorithm options (each names a function of realhf.impl.model.utils.ppo_functional)
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce++")
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
MISMATCH_CORRECTIONS = ("none", "tis", "mis")


@dataclasses.dataclass
class SamplingConfig(GenerationHyperparameters):
    """How answers are sampled (``ppo.gen``): the sampling section without ``n``, which the experiment gives
    (``group_size``); :meth:`to_hyperparameters` builds the engine's options for ``n`` answers per prompt."""

    n: int = dataclasses.field(default=1, init=False, repr=False,  # not an option: the experiment's group_size
                               metadata={"omegaconf_ignore": True, "help": "samples per prompt (group_size)"})

    def to_hyperparameters(self, n: Optional[int] = 1) -> GenerationHyperparameters:
        """The engine's options for ``n`` answers per prompt."""
        return super().to_hyperparameters(n)


# The ``gen`` experiment's sampling section is the contract's own class (``n``: samples per prompt); the old name
# stays for code that imports it.
GenConfig = GenerationHyperparameters


@dataclasses.dataclass
class PPOHyperparameters:
    """PPO / GRPO algorithm options."""

    gen: SamplingConfig = option(help="sampling options of actor_gen (group_size answers per prompt)",
                                 factory=SamplingConfig)
    ppo_n_minibatches: int = option(4, "PPO minibatches (optimizer steps) per training step")
    kl_ctl: float = option(0.1, "coefficient of the KL penalty added to the reward (0 = none): per token with a critic "
                           "(and with adv_estimator=reinforce++); without one, each answer's reward loses kl_ctl times "
                           "its summed KL before the group baseline. Runs ref_inf")
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
    mask_too_long: bool = option(False, "drop answers cut at max_new_tokens from the loss (DAPO's overlong filtering)")
    adv_norm: bool = option(True, "normalise advantages over the batch (every data-parallel rank; REINFORCE++'s global "
                                  "normalisation)")
    group_adv_norm: bool = option(False, "divide advantages by the standard deviation of each prompt's group (GRPO; "
                                         "false: Dr. GRPO's advantage, the reward minus the group mean)")
    skip_zero_advantage: bool = option(
        False, "actor_train runs only on answers whose advantage is nonzero at some token (GRPO: the groups whose "
        "rewards differ); the others give no policy gradient, so this saves their forward and backward passes. The "
        "loss becomes a token mean over the kept answers, and a step where no answer has a nonzero advantage makes "
        "no update. Needs kl_loss_coef=0 and entropy_coef=0 (those terms train every answer)")
    behav_imp_weight_cap: Optional[float] = option(
        None, "decoupled PPO (async-ppo-math): tokens whose behaviour importance weight exp(proximal - behaviour "
        "log-prob) exceeds this cap leave the loss (null = no cap; > 1)")
    adv_estimator: str = option(
        "grpo", "critic-free advantages (use_critic=false): grpo (reward minus its group's mean, divided by the group's "
        "std with group_adv_norm) | rloo (reward minus the mean of the other answers to its prompt; group_size >= 2) "
        "| reinforce++ (per token, the return of the KL-shaped reward, no baseline; whitened over the batch with "
        "adv_norm)")
    policy_loss: str = option(
        "ppo", "the policy loss: ppo (clipped token ratios) | gspo (one ratio per answer, the geometric mean of its "
        "token ratios, clipped per answer; GSPO's paper uses eps_clip=3e-4, eps_clip_higher=4e-4)")
    eps_clip_higher: Optional[float] = option(
        None, "upper clip of the ratio, 1 + eps_clip_higher (DAPO's clip-higher, e.g. 0.28; null = eps_clip)")
    loss_agg_mode: Optional[str] = option(
        None, "how token losses make the loss: token-mean (every answer token weighs alike: DAPO's token-level loss) | "
        "seq-mean-token-mean (mean over answers of each answer's token mean: GRPO) | seq-mean-token-sum-norm (mean "
        "over answers of each answer's token sum over ppo.gen.max_new_tokens: Dr. GRPO); null = the policy loss's "
        "own: token-mean for ppo, seq-mean-token-mean for gspo")
    kl_estimator: str = option("k1", "KL estimator of the reward's penalty (kl_ctl): k1 log(p/q) | k2 "
                                     "0.5*log(p/q)^2 | k3 q/p - 1 - log(q/p)")
    kl_loss_estimator: str = option("k3", "KL estimator of the loss term (kl_loss_coef): k1 | k2 | k3")
    overlong_tokens: int = option(
        0, "DAPO's overlong reward shaping: an answer longer than ppo.gen.max_new_tokens - overlong_tokens loses "
        "overlong_penalty_factor * (excess / overlong_tokens) of reward, reaching the whole factor at "
        "max_new_tokens (0 = off)")
    overlong_penalty_factor: float = option(1.0, "the overlong penalty at max_new_tokens (overlong_tokens > 0)")
    dynamic_sampling: bool = option(
        False, "DAPO's dynamic sampling: drop the prompts whose answers all got the same reward (no group signal) "
        "and generate more until the batch is full again (ppo-math: at most 10 batches per step, then the batch is "
        "filled with dropped prompts; async-ppo-math: the rollout workers replace them). Needs group_size >= 2")
    mismatch_correction: str = option(
        "none", "train-inference mismatch correction of the generator's log-probs: none | tis (truncated importance "
        "sampling: each token's weight exp(trainer - generator log-prob) capped at mismatch_cap) | mis (masked: "
        "tokens whose weight exceeds mismatch_cap leave the loss). In ppo-math it adds actor_inf, a forward pass "
        "of the trained policy before actor_train; in async-ppo-math it corrects the decoupled loss's behaviour "
        "weight")
    mismatch_cap: float = option(2.0, "the cap C of mismatch_correction (> 1)")

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
        self._check_algorithm()

    def _check_algorithm(self):
        """The options of the algorithm variants (docs/algorithms.md)."""
        check_choice("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        if self.eps_clip_higher is not None:
            check_number("eps_clip_higher", self.eps_clip_higher, lo=0, lo_open=True)
        if self.loss_agg_mode is not None:
            check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_loss_estimator", self.kl_loss_estimator, KL_ESTIMATORS)
        check_int("overlong_tokens", self.overlong_tokens, 0)
        if self.overlong_tokens > self.gen.max_new_tokens:
            raise ValueError(f"ppo.overlong_tokens={self.overlong_tokens} is not allowed; the overlong buffer must fit "
                             f"in ppo.gen.max_new_tokens={self.gen.max_new_tokens}")
        check_number("overlong_penalty_factor", self.overlong_penalty_factor, lo=0, lo_open=True)
        check_choice("mismatch_correction", self.mismatch_correction, MISMATCH_CORRECTIONS)
        check_number("mismatch_cap", self.mismatch_cap, lo=1, lo_open=True)
        if self.mismatch_correction != "none" and self.behav_imp_weight_cap is not None:
            raise ValueError(f"ppo.behav_imp_weight_cap={self.behav_imp_weight_cap} and ppo.mismatch_correction="
                             f"{self.mismatch_correction} both cap the behaviour importance weight: use "
                             "ppo.mismatch_cap with mismatch_correction (mis masks as behav_imp_weight_cap does)")
        if self.policy_loss == "gspo" and self.c_clip is not None:
            raise ValueError(f"ppo.c_clip={self.c_clip} (dual clip) is a token-level PPO clip; ppo.policy_loss=gspo "
                             "clips one ratio per answer: leave ppo.c_clip null")

    def loss_aggregation(self) -> str:
        """The loss aggregation in effect (``loss_agg_mode``, or the policy loss's own)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"

    def behaviour_weight(self):
        """(cap, mode) of the behaviour importance weight: the mismatch correction's, else behav_imp_weight_cap's."""
        if self.mismatch_correction == "tis":
            return self.mismatch_cap, "truncate"
        if self.mismatch_correction == "mis":
            return self.mismatch_cap, "mask"
        return self.behav_imp_weight_cap, "mask"
