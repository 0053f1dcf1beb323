"""The error of a tensor-parallel group (its own module: group.py and step_channel.py both
raise it)."""
from __future__ import annotations


class GroupError(RuntimeError):
    """A collective failed or passed its deadline: a rank died or hung. The worker's ranks
    cannot continue in lockstep; the whole group is restarted."""
