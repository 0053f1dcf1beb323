"""The model: decoder, layers, attention backends, weights (safetensors, GGUF, presets),
tokenizer, and the loader that turns `--model` into all of them."""
