"""Which network interface the collectives bind to.

gloo (and NCCL's bootstrap) listen on one interface: ``GLOO_SOCKET_IFNAME``
(``NCCL_SOCKET_IFNAME``) when set, else whatever the host name resolves to,
which on most machines is a public address. The launcher therefore always
names the interface: the user's when they set one, else the interface that
routes to ``MASTER_ADDR`` (loopback when the master is ``127.0.0.1``, the
single-machine default), so nothing listens where the user did not point.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

__all__ = ["route_interface", "interface_of"]


def interface_of(ip: str) -> str | None:
    """The name of the local interface that holds the address ``ip`` (``None`` if none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def route_interface(master_addr: str, port: int = 29500) -> tuple[str, str]:
    """``(interface, local address)`` this machine uses to reach ``master_addr``.

    Loopback masters give the loopback interface. Otherwise the kernel's routing
    table decides (a UDP ``connect`` sends nothing; it only picks the source
    address), and the interface holding that address is the answer.

    Raises:
        OSError: ``master_addr`` does not resolve, or no interface routes to it.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, port, proto=socket.IPPROTO_UDP)[0]
    ip = sockaddr[0]
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        local = ip
    else:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            local = s.getsockname()[0]
    name = interface_of(local.split("%")[0])
    if name is None:
        raise OSError(f"no local interface holds {local}, the address that routes to {master_addr}")
    return name, local
