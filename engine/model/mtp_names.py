"""Where Hugging Face checkpoints keep their MTP layers: tensor names and config keys.

Plain name mapping, no torch: the target's loader (weights.py) skips these tensors and the
MTP head's loader (spec/mtp_head.py) reads them, so both import it from here.
"""
from __future__ import annotations

import re

# checkpoint module name -> ours, per naming style (anything else belongs to the decoder block)
_DEEPSEEK_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                 "shared_head.norm": "norm"}
_DEEPSEEK_SHARED = ("embed_tokens", "shared_head.head")  # copies of the target's; not loaded
_MIMO_OWN = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
             "final_layernorm": "norm"}
_DEEPSEEK_RE = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")
_MIMO_RE = re.compile(r"(?:model\.)?mtp_layers\.(\d+)\.(.+)")


def mtp_checkpoint_name(name: str, num_layers: int) -> tuple[int, str | None] | None:
    """Map a checkpoint tensor name to (MTP layer index, our name under layers.{i}.), or
    (index, None) for a shared copy we skip; None when the tensor is not an MTP tensor.
    MiMo's input_proj comes back as "eh_proj.weight#mimo" (its halves need swapping)."""
    m = _MIMO_RE.fullmatch(name)
    if m is not None:
        index, rest = int(m.group(1)), m.group(2)
        table, suffix = _MIMO_OWN, "#mimo"
    else:
        m = _DEEPSEEK_RE.fullmatch(name)
        if m is None or int(m.group(1)) < num_layers:
            return None
        index, rest = int(m.group(1)) - num_layers, m.group(2)
        if rest.startswith(_DEEPSEEK_SHARED):
            return index, None
        table, suffix = _DEEPSEEK_OWN, ""
    for theirs, ours in table.items():
        if rest.startswith(theirs + "."):
            tail = rest[len(theirs) + 1:]
            return index, f"{ours}.{tail}" + (suffix if ours == "eh_proj" else "")
    return index, f"block.{rest}"


def hf_num_mtp_layers(config_json: dict) -> int:
    """MTP layers a config.json declares (DeepSeek / MiMo: num_nextn_predict_layers)."""
    for key in ("num_nextn_predict_layers", "num_mtp_layers", "mtp_layers"):
        value = config_json.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
