"""Execution on the device: the model runner, sampler, CUDA graphs, overlapped decode and the
host <-> device staging they share."""
