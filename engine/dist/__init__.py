"""Tensor parallelism: one engine over N ranks (docs/tensor_parallel.md).

heads.py (torch-free) splits heads, KV heads, MLP and vocabulary across ranks and plans which
prefill rank each decode rank pulls its KV head slices from; config.py and group.py hold the
process group; protocol.py the lockstep step messages; shard.py cuts a full model's tensors
into a rank's shard; parallel.py the collectives of the parallel forward (which
engine/model/decoder.py calls); lockstep.py the leader and follower of a step; rank.py a rank's
engine parts (its shard, the offline engine's follower processes).
"""
