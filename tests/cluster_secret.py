"""The cluster secret the test harnesses give every worker they start and attach to every
call they make (one per test process, like one per `pdserve serve` run)."""
from __future__ import annotations

from pdserve.proto.rpc import new_cluster_secret

SECRET = new_cluster_secret()
