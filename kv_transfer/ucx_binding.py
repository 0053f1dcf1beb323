"""Which network interfaces NIXL's UCX backend may listen on: the worker's own.

UCX opens a TCP listener on every network interface it finds (with a worker bound to
127.0.0.1, one was still up on the machine's external address), and the KV cache behind it
needs no credential once a peer holds the NIXL metadata. So a worker restricts UCX to the
interface that carries its configured host: `lo` for 127.0.0.1 (a one-node cluster), the
NIC of its address otherwise. UCX reads UCX_NET_DEVICES when the NIXL agent is created, so
the worker process's entry point (worker/actor.py) calls bind_ucx() before any engine or
transport exists. An operator's own UCX_NET_DEVICES (RDMA HCAs, say) is kept as given.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

log = logging.getLogger(__name__)

ANY_HOSTS = ("0.0.0.0", "::", "")


def interface_for(host: str) -> str | None:
    """The network interface holding `host`'s address; None for a wildcard host.
    Raises ValueError when no local interface has it."""
    if host in ANY_HOSTS:
        return None
    import psutil  # a Ray dependency

    try:
        addrs = {ipaddress.ip_address(info[4][0].split("%")[0])
                 for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, ValueError) as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e}") from e
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(entry.address.split("%")[0]) in addrs:
                        return name
                except ValueError:
                    continue
    raise ValueError(f"host: no local network interface has the address of {host!r}")


def bind_ucx(host: str) -> str | None:
    """Restrict UCX to the interface of `host` for this process (UCX_NET_DEVICES), unless
    the operator set it. Returns the devices UCX will use (None = all of them)."""
    given = os.environ.get("UCX_NET_DEVICES")
    if given:
        log.info("UCX_NET_DEVICES=%s (set by the operator) kept", given)
        return given
    iface = interface_for(host)
    if iface is None:
        log.warning("worker host %r: NIXL/UCX listens on every interface", host)
        return None
    os.environ["UCX_NET_DEVICES"] = iface
    return iface
