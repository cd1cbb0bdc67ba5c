"""RL algorithm pieces: config, group advantages, off-policy weights and the policy loss."""

from moe_rl.algorithms.advantages import GroupAdvantages, group_advantages, sample_advantages
from moe_rl.algorithms.config import AlgorithmConfig
from moe_rl.algorithms.policy_loss import make_policy_loss, policy_metrics

__all__ = [
    "AlgorithmConfig",
    "GroupAdvantages",
    "group_advantages",
    "make_policy_loss",
    "policy_metrics",
    "sample_advantages",
]
