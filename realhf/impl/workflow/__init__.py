"""Rollout workflows of asynchronous RL (``realhf.api.core.workflow_api``): importing this package registers
``rlvr`` (one turn, verifiable reward) and ``multi_turn`` (retry after feedback); ``rewards`` holds the default
reward (``MathReward``) and the loader of a user's reward by import path."""
from realhf.api.core.workflow_api import episode_data, make_workflow
from realhf.impl.workflow.multi_turn import MultiTurnWorkflow
from realhf.impl.workflow.rewards import DEFAULT_REWARD_FN, MathReward, call_reward, load_reward_fn
from realhf.impl.workflow.rlvr import RLVRWorkflow

__all__ = ["DEFAULT_REWARD_FN", "MathReward", "MultiTurnWorkflow", "RLVRWorkflow", "call_reward", "episode_data",
           "load_reward_fn", "make_workflow"]
