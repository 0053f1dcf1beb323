"""Re-export of engine/core/tp.py, where the head splits and KV pull plans live (torch-free,
importable by kv_transfer/ too); the engine's TP code keeps importing them from here."""
from pdserve.engine.core.tp import (
    TP_MAP_VERSION,
    HeadPull,
    HeadSplit,
    TPKVInfo,
    check_model_split,
    even_split,
    local_shapes,
    pull_plan,
    slice_ranges,
    tp_pair_problems,
    vocab_shard,
)

__all__ = ["TP_MAP_VERSION", "HeadPull", "HeadSplit", "TPKVInfo", "check_model_split",
           "even_split", "local_shapes", "pull_plan", "slice_ranges", "tp_pair_problems",
           "vocab_shard"]
