"""MTP speculative decoding: the MTP head, drafting, verification and their CUDA graphs."""
