"""The engine's torch-free core: configuration, the request and its sampling parameters, the
scheduler, the paged KV block manager and the detokenizer. Nothing here imports torch, so it
is unit-tested as plain Python."""
