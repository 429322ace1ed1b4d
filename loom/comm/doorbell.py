"""Doorbells: wake another process's sleeping poller on this host when a message is on its way to it.

MPI gives no file descriptor to wait on, so a process waiting for a message either spins (a core per waiting
rank) or polls with back-off. Back-off polling is late by up to its sleep, and each wake-up costs a few
microseconds: in the first 16 ms of every wait the poller wakes ~40 times, which on a node with more ranks than
cores adds up to most of a core per busy Dask process (``loom bench dask``'s cpu columns). A doorbell is the
missing wake-up. The data still moves through MPI; a ring only says "test now".

Plan (one doorbell per process, created by the first user that can be rung, e.g. the Dask backend):

- **Bell socket.** An abstract-namespace Unix datagram socket ``\\0loom-bell.<host key>.<pid>``. The poller of
  every event loop watches it (``add_reader``); a ring is one byte sent to it, and the poller drains it on wake.
- **Sleep flag.** A 64-byte file ``/dev/shm/loom-bell.<host key>.<pid>``, mapped by the owner and by every peer
  that may ring it. Its first byte counts the owner's pollers asleep. A sender reads it (a memory load) and rings
  only when it is non-zero, so a message to a busy or spinning process costs no system call.
- **No lost wake-up.** A poller raises the flag, passes a full memory barrier, tests every pending item twice
  more (MPI's non-blocking probe matches before it progresses, so a message already in shared memory is seen
  by the second probe), and only then sleeps; a sender posts its MPI message, passes a barrier, then reads the
  flag. Either the sender sees the flag or the poller's last tests see the message (Dekker's argument). The
  poller still keeps its timer armed (its back-off cap, 2 ms) for rings that never come: a busy merge showed
  1-2 % of such sleeps ended by the timer with a message waiting, cause not yet known. A missed ring costs
  latency, never a hang.
- **Same user only.** The flag file is created exclusively (``O_EXCL``), never through a link (``O_NOFOLLOW``),
  mode 0600, and checked to be this user's regular file; a peer maps it only when it is its own user's. The
  socket takes credentials with every datagram (``SO_PASSCRED``: the kernel stamps the sender's uid, which for
  a datagram socket replaces ``SO_PEERCRED``), and a ring from another uid is dropped (counted in
  ``foreign``), so another user can neither wake this process's pollers nor make them spin. Stale-file
  clean-up removes only this user's files, also as root.
- **Who may ring whom.** A peer learns this process's :func:`address` ``(pid, host key)`` in-band (the Dask
  backend's connection handshake) and opens a :class:`Bell` only when the host key equals its own: the same
  boot and the same network, mount and pid namespaces, so the socket name, /dev/shm and the pid mean the same
  process. A ring that fails (the peer exited) disables that bell; the peer then wakes on its timer alone.

``LOOM_DOORBELL=0`` turns doorbells off (pollers back off on timers alone).
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import mmap
import os
import socket
import stat
import struct
import sys
import threading

from .. import settings
from .launch import pid_alive

__all__ = ["Doorbell", "Bell", "get", "current", "address", "host_key", "fence"]

_DIR = "/dev/shm"
_FLAG_BYTES = 64
_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (a lock's atomic read-modify-write), ordering a store before the next load."""
    _FENCE.acquire()
    _FENCE.release()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns(name: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{name}").st_ino)
    except OSError:
        return ""


_HOST_KEY: int | None = None


def host_key() -> int:
    """64 bits naming this boot and this process's network, mount and pid namespaces: two processes with the
    same key reach each other's abstract sockets and /dev/shm, and agree on what a pid means."""
    global _HOST_KEY
    if _HOST_KEY is None:
        text = "|".join([_read("/proc/sys/kernel/random/boot_id"), _ns("net"), _ns("mnt"), _ns("pid")])
        _HOST_KEY = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") or 1
    return _HOST_KEY


def _socket_name(key: int, pid: int) -> bytes:
    return f"\0loom-bell.{key:016x}.{pid}".encode()


def _flag_path(key: int, pid: int) -> str:
    return os.path.join(_DIR, f"loom-bell.{key:016x}.{pid}")


_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CRED_SPACE = socket.CMSG_SPACE(_CRED.size)


def _sender_uid(ancdata: list) -> int | None:
    """The uid the kernel stamped on a datagram (``SCM_CREDENTIALS``), or ``None`` without one."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CRED.size:
            return _CRED.unpack_from(data)[1]
    return None


def _check_own(fd: int, path: str) -> None:
    """Refuse a flag file that is not a regular file of this user (another user's, a device, a fifo)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a regular file of uid {os.geteuid()} (uid {st.st_uid}, mode "
                              f"{stat.filemode(st.st_mode)}); doorbells stay off")
    if st.st_size < _FLAG_BYTES:
        raise ValueError(f"{path} is {st.st_size} bytes, not a doorbell flag ({_FLAG_BYTES})")


def _create_flag(path: str) -> mmap.mmap:
    """Create this process's flag file: exclusively, not through a link, mode 0600, and verified to be ours.

    A file already there under this pid is a leftover of a dead process of the same pid (it is removed when
    it is this user's regular file, then created again); anything else (another user's file, a link) makes
    the doorbell unavailable rather than write through it.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{path} exists and is not a regular file of this user; doorbells stay off") \
                from None
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, _FLAG_BYTES)
        _check_own(fd, path)
        return mmap.mmap(fd, _FLAG_BYTES)
    finally:
        os.close(fd)


class Doorbell:
    """This process's doorbell: the socket its pollers watch and the flag that says they sleep."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.key = host_key()
        self._lock = threading.Lock()
        self._clean_stale()
        path = _flag_path(self.key, self.pid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(_socket_name(self.key, self.pid))
            self.flag = _create_flag(path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.fd = sock.fileno()
        self.path = path
        self.rings = 0  # datagrams drained (rings that reached this process while a poller slept)
        self.foreign = 0  # datagrams from another user, dropped
        atexit.register(self.close)

    def _clean_stale(self) -> None:
        """Remove this user's flag files of processes with this host key that died without cleaning up
        (SIGKILL). Never another user's, even as root: only their owner knows whether they are in use."""
        uid = os.geteuid()
        for path in glob.glob(os.path.join(_DIR, f"loom-bell.{self.key:016x}.*")):
            try:
                pid = int(path.rsplit(".", 1)[1])
                st = os.lstat(path)
            except (ValueError, OSError):
                continue
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            if pid != self.pid and not pid_alive(pid):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def sleeping(self) -> None:
        """A poller is about to sleep: raise the flag, then a barrier (before the poller's last test)."""
        with self._lock:
            self.flag[0] = min(255, self.flag[0] + 1)
        fence()

    def awake(self) -> None:
        """A poller woke up: lower the flag."""
        with self._lock:
            if self.flag[0]:
                self.flag[0] -= 1

    def drain(self) -> int:
        """Read every pending ring; returns how many came from this user (others are dropped)."""
        n = 0
        recvmsg = self.sock.recvmsg
        uid = os.geteuid()
        while True:
            try:
                _, anc, _, _ = recvmsg(64, _CRED_SPACE)
            except OSError:  # BlockingIOError: drained
                break
            if _sender_uid(anc) == uid:
                n += 1
            else:
                self.foreign += 1
        self.rings += n
        return n

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class Bell:
    """A handle on a peer process's doorbell: :meth:`ring` wakes it if one of its pollers sleeps."""

    __slots__ = ("pid", "_flag", "_name", "dead", "sent")

    def __init__(self, pid: int, key: int):
        self.pid = pid
        self._name = _socket_name(key, pid)
        fd = os.open(_flag_path(key, pid), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            _check_own(fd, _flag_path(key, pid))
            self._flag = mmap.mmap(fd, _FLAG_BYTES, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.dead = False
        self.sent = 0

    @classmethod
    def open(cls, pid: int, key: int) -> "Bell | None":
        """The bell of process ``pid`` if it can be rung from here (same host key, its doorbell exists)."""
        if not pid or key != host_key() or current() is None:
            return None
        try:
            return cls(pid, key)
        except (OSError, ValueError):
            return None

    def ring(self) -> None:
        """Call after posting a message to the peer: wakes it when it sleeps, else costs one memory load."""
        if self.dead:
            return
        fence()
        if self._flag[0]:
            try:
                _SENDER.sendto(b"\1", self._name)
                self.sent += 1
            except (BlockingIOError, InterruptedError):
                pass  # its socket is full of rings: it is being woken already
            except OSError:
                self.dead = True  # the peer is gone (ECONNREFUSED, ENOENT)


_DOORBELL: Doorbell | None = None
_SENDER: socket.socket | None = None
_DOORBELL_LOCK = threading.Lock()


def get() -> Doorbell | None:
    """This process's doorbell, created on first call; ``None`` where doorbells are off or unavailable
    (``LOOM_DOORBELL=0``, not Linux, no /dev/shm)."""
    global _DOORBELL, _SENDER
    bell = _DOORBELL
    if bell is not None and bell.pid == os.getpid():
        return bell
    if not settings.get("doorbell") or not sys.platform.startswith("linux") \
            or not os.path.isdir(_DIR):
        return None
    with _DOORBELL_LOCK:
        if _DOORBELL is None or _DOORBELL.pid != os.getpid():  # none yet, or inherited across a fork
            try:
                _SENDER = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                        | socket.SOCK_CLOEXEC)
                _DOORBELL = Doorbell()
            except OSError:
                _DOORBELL = None
                return None
        return _DOORBELL


def current() -> Doorbell | None:
    """This process's doorbell if one was created (never creates one)."""
    bell = _DOORBELL
    return bell if bell is not None and bell.pid == os.getpid() else None


def address() -> tuple[int, int]:
    """``(pid, host key)`` a peer needs to ring this process, or ``(0, 0)`` when it has no doorbell."""
    bell = current()
    return (bell.pid, bell.key) if bell is not None else (0, 0)
