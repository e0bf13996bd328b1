"""``reward``: how the answers of ``ppo-math`` and ``async-ppo-math`` are scored.

One section for both places that score: the synchronous run's reward MFC (``rew_inf``, the ``rw-math``
interface) and the asynchronous run's rollout workflows (``async_rl.reward_fn``, by default ``MathReward``). Both
are built from :meth:`RewardConfig.grader_args` and grade alike (``realhf.impl.workflow.rewards.MathReward``).
``ppo.reward_output_scaling`` and ``ppo.reward_output_bias`` then turn a score into the reward PPO trains on.

The options were top-level before (``correct_reward``, ``reward_timeout_secs``, ...): the old names stay as
deprecated aliases (:data:`RENAMED_REWARD_KEYS`), which the loader maps to these with a warning.
"""
import dataclasses
from typing import Any, Dict

from realhf.api.quickstart.options import check_choice, check_number, option
from realhf.api.quickstart.sections import ModelConfig

# reward.type: the rule-based grader, a trained reward model (e.g. a checkpoint of the rw experiment), or their sum
REWARD_TYPES = ("grader", "model", "model+grader")


@dataclasses.dataclass
class RewardConfig:
    """Rule-based scoring of math answers: the final answer stated (``\\boxed{}``, "The answer is ...") is compared
    with the reference solutions, time-bounded."""

    correct_reward: float = option(5.0, "reward of a correct final answer")
    wrong_reward: float = option(-5.0, "reward of a wrong or missing final answer")
    timeout_secs: float = option(5.0, "time limit of grading one answer (a timeout counts as wrong)")
    allow_last_number: bool = option(False, "grade the last number of an answer when it has no \\boxed{} or 'The "
                                            "answer is' (a lenient format for small models)")
    unfinished_as_wrong: bool = option(False, "an answer cut by ppo.gen.max_new_tokens before it ends (no EOS/stop "
                                              "token) scores wrong_reward, whatever it states")
    type: str = option("grader", "grader (the rule-based grading above) | model (a reward model scores each "
                                 "sequence: its scalar head at the last token; reward.model.path, e.g. a checkpoint of "
                                 "the rw experiment) | model+grader (the sum of the model's score and the grade); "
                                 "ppo.reward_output_bias and ppo.reward_output_scaling apply to all three")
    model: ModelConfig = option(help="reward.type=model or model+grader: the reward model, a Hugging Face folder with "
                                     "a scalar head (score.weight, as *ForSequenceClassification stores it) and the "
                                     "policy's tokenizer; it runs as rew_inf with rew_inf's layout and micro-batches",
                                factory=ModelConfig)

    def __post_init__(self):
        check_number("correct_reward", self.correct_reward)
        check_number("wrong_reward", self.wrong_reward)
        check_number("timeout_secs", self.timeout_secs, lo=0, lo_open=True)
        check_choice("type", self.type, REWARD_TYPES)  # its agreement with the other options: PPOMathConfig

    def uses_model(self) -> bool:
        """Whether a reward model scores the answers (``type`` model or model+grader)."""
        return self.type != "grader"

    def grader_args(self) -> Dict[str, Any]:
        """The keyword arguments of the grader (``rw-math``'s, ``MathReward``'s, a user reward class's)."""
        return dict(correct_reward=self.correct_reward, wrong_reward=self.wrong_reward, timeout_secs=self.timeout_secs,
                    allow_last_number=self.allow_last_number, unfinished_as_wrong=self.unfinished_as_wrong)


# old option name -> its name in the ``reward`` section (deprecated aliases the loader still accepts)
RENAMED_REWARD_KEYS = {
    "correct_reward": "reward.correct_reward",
    "wrong_reward": "reward.wrong_reward",
    "reward_timeout_secs": "reward.timeout_secs",
    "reward_allow_last_number": "reward.allow_last_number",
    "reward_unfinished_as_wrong": "reward.unfinished_as_wrong",
}
