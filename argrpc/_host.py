"""Host identity: what decides whether two processes can share memory."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import socket

__all__ = ["HostIdentity", "local_identity", "same_host_reason", "target_host", "target_is_local"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_NETNS_PATH = "/proc/self/ns/net"


@dataclasses.dataclass(frozen=True)
class HostIdentity:
    boot_id: str   # "" when unknown: never considered the same host
    netns: int     # inode of the network namespace; 0 when unknown
    hostname: str  # informational only (containers share boot_id but not hostnames)
    uid: int
    pid: int

    def to_proto(self, msg: object) -> None:
        """Fill a bootstrap HostIdentity message in place."""
        msg.boot_id = self.boot_id  # type: ignore[attr-defined]
        msg.netns = self.netns  # type: ignore[attr-defined]
        msg.hostname = self.hostname  # type: ignore[attr-defined]
        msg.uid = self.uid  # type: ignore[attr-defined]
        msg.pid = self.pid  # type: ignore[attr-defined]

    @classmethod
    def from_proto(cls, msg: object) -> "HostIdentity":
        return cls(boot_id=msg.boot_id, netns=msg.netns, hostname=msg.hostname,  # type: ignore[attr-defined]
                   uid=msg.uid, pid=msg.pid)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    # Bytes, decoded after: a text-mode open with encoding="ascii" imports the codec
    # module, which cost a new process about a millisecond of its first call.
    try:
        with open(_BOOT_ID_PATH, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""


def _netns() -> int:
    # Not cached: setns() can move the process; a stat is cheap and this runs once per
    # negotiation.
    try:
        return os.stat(_NETNS_PATH).st_ino
    except OSError:
        return 0


def local_identity() -> HostIdentity:
    """This process's identity (pid and netns re-read on every call: fork, setns)."""
    return HostIdentity(boot_id=_boot_id(), netns=_netns(), hostname=socket.gethostname(),
                        uid=os.getuid(), pid=os.getpid())


def same_host_reason(local: HostIdentity, peer: HostIdentity) -> str:
    """"" if `peer` can share memory with `local` (same kernel boot, same network
    namespace so the abstract Unix socket is reachable, same user); else the reason."""
    if not local.boot_id or not peer.boot_id or not local.netns or not peer.netns:
        return "different host or network namespace (host identity unknown)"
    if local.boot_id != peer.boot_id or local.netns != peer.netns:
        return "different host or network namespace"
    if local.uid != peer.uid:
        return f"different user (uid {peer.uid} vs {local.uid})"
    return ""


def target_host(target: str) -> str:
    """The host part of a gRPC target ("" if there is none)."""
    t = target.strip()
    if t.startswith("unix:") or t.startswith("unix-abstract:"):
        return "localhost"
    if t.startswith("dns://"):
        t = t[len("dns://"):].split("/", 1)[-1]  # drop the (optional) DNS authority
    for prefix in ("dns:", "ipv4:", "ipv6:"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    t = t.split(",", 1)[0]  # ipv4:a:p,b:p lists: the first address is enough
    if t.startswith("["):
        return t[1:t.index("]")] if "]" in t else ""
    if t.count(":") == 1:
        return t.rsplit(":", 1)[0]
    return t  # a bare name, or a bare IPv6 address


def target_is_local(target: str) -> bool:
    """Whether a gRPC target names this host: "localhost", this host's name, or an
    address bound here. No DNS lookup is made for other names (they count as remote)."""
    host = target_host(target)
    if not host:
        return False
    if host.lower() in ("localhost", "localhost.localdomain") or host == socket.gethostname():
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    # Only an address of one of this host's interfaces can be bound.
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False
