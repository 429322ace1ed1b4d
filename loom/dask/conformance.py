"""Address-generic behaviour checks for a Dask comm backend, written for loom's ``mpi://`` transport.

They cover what Dask's own transport suite (``distributed/comm/tests/test_comms.py``) asks of every backend —
client/server round trips with many concurrent clients, implicit and explicit close, connect time-outs,
many listeners, the ``deserialize`` flag on both ends, round trips of large payloads, truncated data,
``repr`` and addresses — plus loom's own: frames split into several MPI messages, a close waking a pending
read, connections to the same rank. Each check is an ``async`` function that raises ``AssertionError``; the
unit tests run them in one process (a 1-rank world) and ``tests/mpi/check_dask.py`` runs the cross-rank ones.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any, Callable

from distributed.comm import CommClosedError, connect, listen, parse_address
from distributed.protocol import Serialized, deserialize, serialize, to_serialize

__all__ = [
    "comm_pair",
    "check_client_server",
    "check_comm_closed_implicit",
    "check_comm_closed_explicit",
    "check_connect_timeout",
    "check_many_listeners",
    "check_deserialize",
    "check_deserialize_roundtrip",
    "check_deserialize_eoferror",
    "check_repr",
    "check_addresses",
    "check_split_frames",
    "check_close_wakes_reader",
    "on_pair",
    "ADDRESS_CHECKS",
    "run_all",
]


async def _raises_closed(awaitable) -> None:
    try:
        await awaitable
    except CommClosedError:
        return
    raise AssertionError("expected CommClosedError")


async def comm_pair(addr: str, *, listen_args: dict | None = None, connect_args: dict | None = None):
    """``(client comm, server comm)`` connected through a listener on ``addr`` (stopped afterwards)."""
    accepted: asyncio.Queue = asyncio.Queue()

    async def handler(comm):
        await accepted.put(comm)

    listener = await listen(addr, handler, **(listen_args or {}))
    try:
        client = await connect(listener.contact_address, **(connect_args or {}))
    finally:
        listener.stop()
    return client, await accepted.get()


async def check_client_server(addr: str, check_listen: Callable[[str], Any] | None = None,
                              check_contact: Callable[[str], Any] | None = None, clients: int = 20) -> None:
    """Ping/pong through a listener, one client then ``clients`` at once; unknown kwargs are ignored."""
    scheme = parse_address(addr)[0]

    async def server(comm):
        try:
            assert parse_address(comm.peer_address)[0] == scheme
            first = await comm.read()
            assert first["op"] == "ping", first
            await comm.write({**first, "op": "pong"})
            second = await comm.read()
            assert second == {"op": "done"}, second
        finally:
            await comm.close()

    listener = await listen(addr, server, unused_listen_kwarg="ignored")
    try:
        bound_scheme, bound_loc = parse_address(listener.listen_address)
        assert bound_scheme == scheme, (listener.listen_address, addr)
        if check_listen is not None:
            check_listen(bound_loc)
        contact = listener.contact_address
        assert parse_address(contact)[0] == scheme
        if check_contact is not None:
            check_contact(parse_address(contact)[1])
        else:
            assert contact == listener.listen_address
        seen: list[int] = []

        async def client(key: int, pause: float = 0.0) -> None:
            comm = await connect(contact, unused_connect_kwarg="ignored")
            try:
                assert comm.peer_address == contact, (comm.peer_address, contact)
                await comm.write({"op": "ping", "key": key})
                await comm.write({"op": "done"})
                if pause:
                    await asyncio.sleep(pause)
                reply = await comm.read()
                assert reply == {"op": "pong", "key": key}, reply
                seen.append(key)
            finally:
                await comm.close()

        await client(-1)
        await asyncio.gather(*(client(k, 0.02) for k in range(clients)))
        assert sorted(seen) == [-1, *range(clients)], seen
    finally:
        listener.stop()


async def check_comm_closed_implicit(addr: str) -> None:
    """A server that closes right after the handshake: the client's next write-then-read or read raises."""

    async def server(comm):
        await comm.close()

    listener = await listen(addr, server)
    try:
        comm = await connect(listener.contact_address)

        async def write_then_read():
            await comm.write({"x": 1})
            await comm.read()

        await _raises_closed(write_then_read())
        comm = await connect(listener.contact_address)
        await _raises_closed(comm.read())
    finally:
        listener.stop()


async def check_comm_closed_explicit(addr: str) -> None:
    """Closing one end: reads already pending on both ends and later reads and writes raise."""
    a, b = await comm_pair(addr)
    a_read = asyncio.ensure_future(a.read())
    b_read = asyncio.ensure_future(b.read())
    await asyncio.sleep(0.01)  # both reads are really waiting
    await a.close()
    await _raises_closed(a_read)
    await _raises_closed(b_read)
    await _raises_closed(a.read())
    await _raises_closed(b.read())
    await _raises_closed(a.write({}))
    await _raises_closed(b.write({}))
    assert a.closed() and b.closed()
    await b.close()


async def check_connect_timeout(addr: str, timeout: float = 0.15) -> None:
    """Connecting where nobody listens raises ``OSError`` after about ``timeout`` seconds, not before."""
    t0 = time.monotonic()
    try:
        await connect(addr, timeout=timeout)
    except OSError:
        dt = time.monotonic() - t0
        assert timeout * 0.6 <= dt <= timeout + 1.0, dt
        return
    raise AssertionError(f"connect({addr!r}) succeeded without a listener")


async def check_many_listeners(addr: str, n: int = 100) -> None:
    """``n`` listeners on one address get ``n`` distinct listen and contact addresses."""

    async def server(comm):
        await comm.close()

    listeners = [await listen(addr, server) for _ in range(n)]
    try:
        assert len({lst.listen_address for lst in listeners}) == n
        assert len({lst.contact_address for lst in listeners}) == n
        comm = await connect(listeners[n // 2].contact_address)  # the middle one still answers
        await _raises_closed(comm.read())
    finally:
        for lst in listeners:
            lst.stop()


async def _listener_reads(addr: str, deserialize_flag: bool, value: Any) -> Any:
    got: asyncio.Queue = asyncio.Queue()

    async def server(comm):
        try:
            got.put_nowait(await comm.read())
        except Exception as exc:  # noqa: BLE001 - re-raised on the test side
            got.put_nowait(exc)
        finally:
            await comm.close()

    listener = await listen(addr, server, deserialize=deserialize_flag)
    try:
        comm = await connect(listener.contact_address)
    finally:
        listener.stop()
    await comm.write(value)
    out = await got.get()
    await comm.close()
    if isinstance(out, Exception):
        raise out
    return out


async def _connector_reads(addr: str, deserialize_flag: bool, value: Any) -> Any:
    release = asyncio.Event()

    async def server(comm):
        try:
            await comm.write(value)
            await release.wait()
        finally:
            await comm.close()

    listener = await listen(addr, server)
    try:
        comm = await connect(listener.contact_address, deserialize=deserialize_flag)
    finally:
        listener.stop()
    try:
        return await comm.read()
    finally:
        release.set()
        await comm.close()


def _plain(value: Any) -> Any:
    """Undo (de)serialisation wrappers for comparison."""
    if isinstance(value, Serialized):
        return deserialize(value.header, value.frames)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if type(value).__name__ == "Serialize":
        return value.data
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


async def check_deserialize(addr: str) -> None:
    """``deserialize=False`` on either end keeps ``Serialized`` payloads; ``True`` restores the values.

    Small values and an 8 MiB incompressible payload (sent as separate frames).
    """
    for payload in (456, os.urandom(1 << 20) * 8):
        msg = {"op": "update", "x": b"abc", "to_ser": [to_serialize(payload)],
               "ser": Serialized(*serialize(payload))}
        for reader in (_listener_reads, _connector_reads):
            out = await reader(addr, False, msg)
            assert out["op"] == "update" and out["x"] == b"abc"
            assert isinstance(out["ser"], Serialized), type(out["ser"])
            assert _plain(out["ser"]) == payload
            (to_ser,) = out["to_ser"]
            assert _plain(to_ser) == payload
            out = await reader(addr, True, msg)
            assert _plain(out["ser"]) == payload and [_plain(v) for v in out["to_ser"]] == [payload]
            assert out["op"] == "update" and out["x"] == b"abc"


async def check_deserialize_roundtrip(addr: str) -> None:
    """A 4 MiB payload goes there and back intact, with ``deserialize`` on and off."""
    blob = os.urandom(1 << 20) * 4
    msg = {"op": "update", "x": blob, "to_ser": [to_serialize(blob)], "ser": Serialized(*serialize(blob))}
    for flag in (True, False):
        a, b = await comm_pair(addr, listen_args={"deserialize": flag}, connect_args={"deserialize": flag})
        try:
            await a.write(msg)
            await b.write(await b.read())
            got = await a.read()
            assert sorted(got) == sorted(msg) and got["op"] == "update" and got["x"] == blob
            if flag:
                assert isinstance(got["ser"], (bytes, bytearray)) and bytes(got["ser"]) == blob
                assert bytes(got["to_ser"][0]) == blob
            else:
                assert isinstance(got["ser"], Serialized) and _plain(got["ser"]) == blob
                assert _plain(got["to_ser"][0]) == blob
        finally:
            await a.close()
            await b.close()


def _raise_eof():
    raise EOFError


class _UnpicklesToEOF:
    def __reduce__(self):
        return _raise_eof, ()


async def check_deserialize_eoferror(addr: str) -> None:
    """Data that fails to deserialise with EOFError closes the comm on both ends."""
    server_saw: asyncio.Queue = asyncio.Queue()

    async def server(comm):
        await comm.write({"data": to_serialize(_UnpicklesToEOF())})
        try:
            await comm.read()
        except CommClosedError:
            server_saw.put_nowait("closed")
        else:
            server_saw.put_nowait("message")

    listener = await listen(addr, server)
    try:
        comm = await connect(listener.contact_address)
        await _raises_closed(comm.read())
        assert await asyncio.wait_for(server_saw.get(), 10) == "closed"
    finally:
        listener.stop()


async def check_repr(a, b) -> None:
    """``repr`` names both addresses and says ``closed`` only once closed."""
    assert "closed" not in repr(a) and "closed" not in repr(b)
    assert a.local_address in repr(b) and b.local_address in repr(a)
    await a.close()
    assert "closed" in repr(a) and a.local_address in repr(a) and b.peer_address in repr(a)
    await b.close()
    assert "closed" in repr(b) and a.local_address in repr(b) and b.peer_address in repr(b)


async def check_addresses(a, b) -> None:
    """Each end's peer address is the other's local address."""
    assert a.peer_address == b.local_address and a.local_address == b.peer_address
    a.abort()
    b.abort()


async def check_split_frames(addr: str, chunk: int = 100_000) -> None:
    """Frames larger than the backend's chunk size arrive intact (the mpi backend splits them)."""
    from . import connection

    old = connection.CHUNK_BYTES
    connection.CHUNK_BYTES = chunk
    try:
        a, b = await comm_pair(addr)
        blob = os.urandom(chunk * 3 + 17)
        await a.write({"blob": to_serialize(blob), "n": 1})
        got = await b.read()
        assert got["n"] == 1 and bytes(got["blob"]) == blob
        await a.close()
        await b.close()
    finally:
        connection.CHUNK_BYTES = old


async def check_close_wakes_reader(addr: str) -> None:
    """``abort()`` on one end wakes a read pending on the other promptly (not at some time-out)."""
    a, b = await comm_pair(addr)
    pending = asyncio.ensure_future(b.read())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    a.abort()
    await _raises_closed(asyncio.wait_for(pending, 10))
    assert time.monotonic() - t0 < 5.0
    await b.close()


def on_pair(check: Callable) -> Callable:
    """``check(a, b)`` as a check of an address: it runs on a fresh connected pair to that address."""

    @functools.wraps(check)
    async def on_addr(addr: str) -> None:
        await check(*await comm_pair(addr))

    return on_addr


# Every check that needs only an address somebody listens on, in the order ``run_all`` runs them.
ADDRESS_CHECKS = (
    check_client_server,
    check_comm_closed_implicit,
    check_comm_closed_explicit,
    check_many_listeners,
    check_deserialize,
    check_deserialize_roundtrip,
    check_deserialize_eoferror,
    on_pair(check_repr),
    on_pair(check_addresses),
    check_split_frames,
    check_close_wakes_reader,
)


async def run_all(addr: str, *, missing: str) -> list[str]:
    """Every address-generic check on ``addr``; ``missing`` is an address nobody listens on. Returns the names
    of the checks run, in order."""
    steps = [(check, addr) for check in ADDRESS_CHECKS]
    steps.insert(3, (check_connect_timeout, missing))
    done = []
    for check, target in steps:
        await check(target)
        done.append(check.__name__.removeprefix("check_"))
    return done
