"""A gRPC target resolved as grpc resolves it, for the schemes that name hosts.

grpc parses a target as a URI; a scheme it has no resolver for (including none at all,
``host:port``) means ``dns:///`` + the target. ``dns`` yields every A/AAAA record of the
host (port 443 when none is given); ``ipv4``/``ipv6`` a comma-separated list; ``unix`` and
``unix-abstract`` one socket. Other resolvers grpc has built in (``xds``, ``google-c2p``,
``vsock``...) are left to grpc: such a channel stays on plain gRPC.

Each address becomes a target of its own that names exactly it (``ipv4:10.0.0.1:50051``),
for the subchannel's gRPC channel, whose ``:authority`` stays the original target's.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading
import time
from typing import Any, Optional

__all__ = ["Resolution", "Resolver", "parse"]

_DEFAULT_PORT = "443"
# grpc's own resolvers other than those above: their names and addresses are grpc's.
_GRPC_ONLY_SCHEMES = frozenset({"xds", "google-c2p", "google-c2p-experimental", "c2p",
                                "vsock", "fake", "sockaddr", "binder"})
_MIN_INTERVAL_KEY = "grpc.dns_min_time_between_resolutions_ms"
_MIN_INTERVAL_DEFAULT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Resolution:
    scheme: str             # "dns", "ipv4", "ipv6", "unix", "unix-abstract"
    endpoint: str           # what the scheme resolves: "host:port", "a:p,b:p", a path
    authority: str          # grpc's default :authority for the target
    unsupported: str = ""   # why argrpc leaves this target to grpc ("" when it resolves it)


def _scheme_of(target: str) -> tuple[str, str]:
    """(scheme, rest) as a URI parser splits it; ("", target) when there is no scheme."""
    head, sep, rest = target.partition(":")
    if not sep or not head or not head[0].isalpha() or \
            not all(c.isalnum() or c in "+-." for c in head):
        return "", target
    return head.lower(), rest


def _path(rest: str) -> str:
    """The URI path of "//authority/path", "///path" or "path", without the leading
    slash grpc strips for host names."""
    if rest.startswith("//"):
        rest = rest[2:]
        rest = rest.split("/", 1)[1] if "/" in rest else ""
    return rest


def parse(target: str) -> Resolution:
    scheme, rest = _scheme_of(target.strip())
    if scheme in ("ipv4", "ipv6"):
        endpoint = _path(rest)
        return Resolution(scheme, endpoint, endpoint)
    if scheme == "unix":
        # "unix:path" and "unix:///abs": the socket's path as grpc reads it.
        path = rest[2:] if rest.startswith("//") else rest
        return Resolution(scheme, path, "localhost")
    if scheme == "unix-abstract":
        return Resolution(scheme, rest, "localhost")
    if scheme == "dns":
        if rest.startswith("//") and not rest.startswith("///"):
            server = rest[2:].split("/", 1)[0]
            return Resolution(scheme, _path(rest), _path(rest),
                              f"target {target!r} names DNS server {server}, which only "
                              "grpc's resolver can ask")
        endpoint = _path(rest)
        return Resolution(scheme, endpoint, endpoint)
    if scheme in _GRPC_ONLY_SCHEMES:
        return Resolution(scheme, rest, rest,
                          f"target scheme '{scheme}:' is resolved by grpc alone")
    # No resolver for the scheme (or no scheme): grpc takes the whole target as a DNS name.
    return Resolution("dns", target.strip(), target.strip())


def _split_host_port(hostport: str) -> tuple[str, str]:
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        return host, tail[1:] if tail.startswith(":") else ""
    if hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
        return host, port
    return hostport, ""  # a bare name, or a bare IPv6 address


def _address_target(family: int, host: str, port: str) -> str:
    if family == socket.AF_INET6:
        return f"ipv6:[{host}]:{port}"
    return f"ipv4:{host}:{port}"


def _lookup(hostport: str) -> list[str]:
    host, port = _split_host_port(hostport)
    port = port or _DEFAULT_PORT
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    else:  # an address literal: no lookup
        return [_address_target(socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                                host, port)]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = _address_target(family, str(sockaddr[0]), port)
        if addr not in out:
            out.append(addr)
    return out


def addresses(res: Resolution) -> list[str]:
    """Every address the target names now, each as a target of its own."""
    if res.unsupported:
        return []
    if res.scheme == "unix":
        return [f"unix:{res.endpoint}"]
    if res.scheme == "unix-abstract":
        return [f"unix-abstract:{res.endpoint}"]
    if res.scheme in ("ipv4", "ipv6"):
        out = []
        for item in res.endpoint.split(","):
            host, port = _split_host_port(item.strip())
            if host and port:
                out.append(_address_target(
                    socket.AF_INET6 if res.scheme == "ipv6" else socket.AF_INET, host, port))
        return out
    return _lookup(res.endpoint)


class Resolver:
    """One channel's resolution: resolved on first use, and again (DNS only) when a
    connection to one of its addresses fails, no more often than grpc's
    ``grpc.dns_min_time_between_resolutions_ms`` allows (30 s by default)."""

    def __init__(self, res: Resolution, grpc_options: Any) -> None:
        self.resolution = res
        self._min_interval_s = _MIN_INTERVAL_DEFAULT_S
        for key, value in tuple(grpc_options or ()):
            if key == _MIN_INTERVAL_KEY and isinstance(value, int) and value >= 0:
                self._min_interval_s = value / 1000.0
        self._lock = threading.Lock()
        self._last = float("-inf")
        self.resolutions = 0  # how many lookups were made (for the metrics and tests)

    def resolve(self) -> list[str]:
        with self._lock:
            self._last = time.monotonic()
            self.resolutions += 1
        return addresses(self.resolution)

    def again(self) -> Optional[list[str]]:
        """The addresses looked up anew, or None when the target is static or the last
        lookup is too recent."""
        if self.resolution.scheme != "dns":
            return None
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._min_interval_s:
                return None
            self._last = now
            self.resolutions += 1
        return addresses(self.resolution)
