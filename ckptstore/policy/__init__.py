"""Per tensor: which codec, keyframe or residual, and (in lossy modes) how many bits."""

from ckptstore.policy.chaincost import AUTO, ChainCosts, chain_limit
from ckptstore.policy.levels import LEVELS, LossyLevel, check_knobs, level_named
from ckptstore.policy.lossless import (
    LOSSLESS_CODEC,
    EncodePlan,
    EncodingSettings,
    after_attempt,
    chunk_sizes,
    cycle_after,
    plan_tensor,
)

__all__ = ["AUTO", "LEVELS", "LOSSLESS_CODEC", "ChainCosts", "EncodePlan", "EncodingSettings", "LossyLevel",
           "after_attempt", "cycle_after", "chain_limit", "check_knobs", "chunk_sizes", "level_named", "plan_tensor"]
