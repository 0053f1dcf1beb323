"""The NIXL calls NixlKVTransport makes, wrapped: the agent it creates, transfer polling under
a deadline, descriptor telemetry, handle release, and NIXL exceptions as KVTransferError."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .errors import KVTransferError, KVTransferTimeout

log = logging.getLogger(__name__)

SPIN_POLLS = 200  # busy polls (GPU reads finish in ms) before backing off
POLL_SLEEP_S = 0.0002


# The UCX backend's progress thread waits this long (µs) on UCX's event fd between polls. nixl's
# Python API hard-codes 0, which makes that thread spin on sched_yield: a whole core per agent,
# idle or not (measured: 100% of a core idle; 2.7% with a delay), stolen from the launch-bound
# decode loop on a GPU node and from every other process on a small one. Incoming traffic
# still wakes the thread at once through the event fd.
PROGRESS_DELAY_US = 100


def make_agent(name: str, backends: Sequence[str], num_threads: int) -> Any:
    # Imported here: `import nixl` loads UCX and CUDA plugins; handshake users don't need it.
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW  # concurrent reads from a pool
    # The Python agent is built without backends, so no progress thread starts with its
    # delay of 0; its native agent is then replaced by one with PROGRESS_DELAY_US before any
    # backend exists. Every other call goes through nixl's own Python API.
    agent = nixl_agent(name, nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False, backends=[], sync_mode=sync))
    native = _bindings.nixlAgentConfig(True, False)  # progress thread, no listen thread
    native.syncMode = sync.value
    native.pthrDelay = PROGRESS_DELAY_US
    native.captureTelemetry = True  # per-transfer descriptor counts
    if isinstance(getattr(agent, "agent", None), _bindings.nixlAgent):
        agent.agent = _bindings.nixlAgent(name, native)
    else:  # a nixl whose Python agent keeps its native one elsewhere: unpaced, but working
        log.warning("nixl %s: cannot pace the UCX progress thread; it will hold a core",
                    getattr(_bindings, "__version__", "?"))
    missing = [b for b in backends if b not in agent.get_plugin_list()]
    if missing:
        raise KVTransferError(f"backends: NIXL plugin(s) {missing} unavailable "
                              f"(have {agent.get_plugin_list()})")
    for backend in backends:
        agent.create_backend(backend, {"num_threads": str(num_threads)} if num_threads else {})
    return agent


def nixl_call(wid: str, what: str, fn: Any, *args: Any) -> Any:
    """fn(*args); a NIXL exception becomes KVTransferError naming the peer and the call."""
    try:
        return fn(*args)
    except Exception as e:
        raise KVTransferError(f"peer {wid!r}: NIXL {what} failed: "
                              f"{type(e).__name__}: {e}") from e


def read_xfer(agent: Any, wid: str, local: Any, local_mem: str, remote: Any,
              ep: Any) -> Any:
    """A READ transfer handle from the remote ranges of `ep` (a RankEndpoint: its agent and
    memory type) into the local ranges; ranges as (address, bytes, device) rows."""
    return nixl_call(wid, "initialize_xfer", agent.initialize_xfer, "READ",
                     agent.get_xfer_descs(local, local_mem),
                     agent.get_xfer_descs(remote, ep.kv_mem_type), ep.agent_name)


def wait_done(agent: Any, handle: Any, state: str, deadline: float, not_before: float,
              wid: str) -> None:
    """Poll until DONE (and not before `not_before`, the injected delay) or deadline."""
    polls = 0
    while True:
        now = time.monotonic()
        if state == "ERR":
            raise KVTransferError(f"peer {wid!r}: NIXL reported the read failed (ERR)")
        if state == "DONE" and now >= not_before:
            return
        if now >= deadline:
            raise KVTransferTimeout(f"peer {wid!r}: read not done by its deadline")
        wake = min(deadline, not_before) if state == "DONE" else deadline
        time.sleep(0 if polls < SPIN_POLLS else min(POLL_SLEEP_S, max(0.0, wake - now)))
        polls += 1
        if state != "DONE":
            state = nixl_call(wid, "check_xfer_state", agent.check_xfer_state, handle)


def descriptor_count(agent: Any, handle: Any, runs: int) -> int:
    try:
        return int(agent.get_xfer_telemetry(handle).descCount)
    except Exception:  # telemetry unavailable: NIXL merges to one descriptor per run
        return runs


def try_release(handle: Any) -> bool:
    try:
        handle.release()
        return True
    except Exception:
        log.warning("releasing NIXL handle %r failed", handle, exc_info=True)
        return False
