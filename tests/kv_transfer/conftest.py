"""Make this folder's helpers (kv_peer_proc) importable by name, in any pytest import mode;
spawned peer processes inherit sys.path, so they can import them too."""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
