"""Network namespaces and TUN devices for the WAN emulator (Linux, root only).

Namespaces are named ``wan-<pid>-<i>`` (or ``<prefix>-<pid>-<i>``) after the process that owns the
emulator, so a run killed before it could clean up leaves names that :func:`remove_stale` recognises
(their owner is gone) and removes at the next start with that prefix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import re
import shutil
import struct
import subprocess

__all__ = [
    "CLONE_NEWNET",
    "enter_netns",
    "list_namespaces",
    "namespace_name",
    "open_tun",
    "remove_namespace",
    "remove_stale",
    "unavailable_reason",
]

CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM = 0x01
_TUN_F_TSO4 = 0x02
_TUN_F_TSO6 = 0x04
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (``None`` when it can): root, ``ip`` and ``/dev/net/tun``."""
    if not os.path.exists("/proc/self/ns/net"):
        return "not Linux (no network namespaces)"
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces and TUN devices)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


def namespace_name(owner_pid: int, index: int, prefix: str = "wan") -> str:
    """The name of host ``index``'s namespace for an emulator owned by ``owner_pid``."""
    if not _PREFIX.match(prefix):
        raise ValueError(f"a namespace prefix is 1..12 lowercase letters and digits, not {prefix!r}")
    return f"{prefix}-{owner_pid}-{index}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def list_namespaces() -> list[str]:
    """Names of the namespaces ``ip netns`` knows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_namespace(name: str) -> None:
    """Delete namespace ``name`` (no error if it is already gone)."""
    _ip("netns", "delete", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = "wan") -> list[str]:
    """Delete the ``<prefix>-<pid>-<i>`` namespaces whose owner process is gone; return their names."""
    removed = []
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-(\d+)$")
    for name in list_namespaces():
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            remove_namespace(name)
            removed.append(name)
    return removed


def enter_netns(path: str) -> None:
    """Move the calling thread (the whole process, if single-threaded) into the namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tun(name: str) -> int:
    """Create TUN device ``name`` in the current namespace with TSO offered; return its fd.

    The device reads and writes ``virtio_net_hdr`` + IP packet, GSO bursts up to 64 KB included. It
    lives as long as the fd (non-persistent). The fd is non-blocking.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
        os.set_blocking(fd, False)
    except BaseException:
        os.close(fd)
        raise
    return fd
