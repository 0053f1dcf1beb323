"""The shared runtime of every worker: core/ (torch-free scheduling), model/, exec/ (device
execution), spec/ (MTP speculative decoding), the LLMEngine step and the offline LLM API.
No networking: the engine imports no grpc, ray, nixl or fastapi."""
