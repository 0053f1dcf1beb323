"""Structured outputs: grammars compiled by xgrammar (compiler.py) and the per-request matcher
state plus the token bitmask applied to the logits on the device (matcher.py)."""
