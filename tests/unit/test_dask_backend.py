"""The mpi:// Dask backend in one process (a 1-rank world: every connection is to the same rank).

The conformance checks (loom.dask.conformance) cover the behaviours Dask's transport suite asks of every
backend; the rest are loom's own: address parsing, errors, the entry point, idle CPU while waiting.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("distributed")

from distributed.comm import CommClosedError, connect, listen  # noqa: E402
from distributed.comm.registry import get_backend  # noqa: E402

from loom.dask import backend as B  # noqa: E402
from loom.dask import conformance as C  # noqa: E402

ADDR = "mpi://"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_entry_point_registers_mpi_scheme():
    assert isinstance(get_backend("mpi"), B.MPIBackend)


def test_client_server():
    run(C.check_client_server(ADDR))


def test_client_server_explicit_host_and_rank():
    eng = B.engine()
    run(C.check_client_server(f"mpi://{eng.host}/{eng.rank}", check_listen=lambda loc: loc.startswith(eng.host)))


def test_comm_closed_implicit():
    run(C.check_comm_closed_implicit(ADDR))


def test_comm_closed_explicit():
    run(C.check_comm_closed_explicit(ADDR))


def test_connect_timeout_without_listener():
    # Port 999999 of this rank: nobody listens (the rank's dispatcher may not even run).
    run(C.check_connect_timeout("mpi://0/999999"))


def test_connect_refused_quickly_while_rank_listens():
    async def main():
        listener = await listen(ADDR, lambda comm: None)
        try:
            # The connector itself is refused at once; distributed's connect() retries until its timeout.
            with pytest.raises(ConnectionRefusedError, match="no listener on port 999998"):
                await B.MPIConnector().connect("0/999998")
            with pytest.raises(OSError):
                await connect("mpi://0/999998", timeout=0.3)
        finally:
            listener.stop()

    run(main())


def test_connect_to_missing_rank_is_oserror():
    async def main():
        with pytest.raises(OSError, match="not in this MPI world"):
            await B.MPIConnector().connect("5/1")

    run(main())


def test_many_listeners():
    run(C.check_many_listeners(ADDR))


def test_deserialize():
    run(C.check_deserialize(ADDR))


def test_deserialize_roundtrip():
    run(C.check_deserialize_roundtrip(ADDR))


def test_deserialize_eoferror():
    run(C.check_deserialize_eoferror(ADDR))


def test_repr():
    async def main():
        await C.check_repr(*await C.comm_pair(ADDR))

    run(main())


def test_addresses():
    async def main():
        await C.check_addresses(*await C.comm_pair(ADDR))

    run(main())


def test_split_frames():
    run(C.check_split_frames(ADDR))


def test_close_wakes_reader():
    run(C.check_close_wakes_reader(ADDR))


def test_numpy_payloads_exact():
    """Random fp64 arrays of several sizes arrive bit-exact, in order: inline frames, separate frames, and one
    above Dask's 10 MiB offload size (serialised on both ends through to_frames/from_frames' thread)."""

    async def main():
        a, b = await C.comm_pair(ADDR)
        rng = np.random.default_rng(0)
        sent = [rng.standard_normal(n) for n in (0, 1, 1000, 100_000, 1_000_000, 12 * 2**20 // 8 + 3)]
        for x in sent:
            await a.write({"x": x})
        for x in sent:
            got = (await b.read())["x"]
            assert got.dtype == np.float64 and np.array_equal(got, x)
        await a.close()
        await b.close()

    run(main())


def test_close_after_writes_delivers_them_first():
    async def main():
        a, b = await C.comm_pair(ADDR)
        for i in range(5):
            await a.write(i)
        await a.close()
        assert [await b.read() for _ in range(5)] == list(range(5))
        with pytest.raises(CommClosedError):
            await b.read()

    run(main())


def test_address_parsing_and_errors():
    assert B.parse_mpi_address("") == (None, None, None)
    assert B.parse_mpi_address("node1/2/7") == ("node1", 2, 7)
    assert B.parse_mpi_address("2/7") == (None, 2, 7)
    assert B.parse_mpi_address("node1/2") == ("node1", 2, None)
    assert B.parse_mpi_address("3") == (None, 3, None)
    with pytest.raises(ValueError, match="rank 'x'"):
        B.parse_mpi_address("node1/x/7")
    with pytest.raises(ValueError, match="listens only on its own"):
        B.MPIListener("node/5/1", lambda c: None)
    backend = get_backend("mpi")
    assert backend.get_address_host("node9/1/2") == "node9"
    assert backend.get_address_host("") == B.engine().host
    assert backend.resolve_address("node9/1/2") == "node9/1/2"
    assert backend.get_local_address_for("node9/1/2") == f"{B.engine().host}/{B.engine().rank}"


def test_explicit_port_in_use_is_eaddrinuse():
    async def main():
        first = await listen(ADDR, lambda c: None)
        try:
            port = first.listen_address.rsplit("/", 1)[1]
            with pytest.raises(OSError, match="already listening"):
                await listen(f"mpi://{B.engine().host}/0/{port}", lambda c: None)
        finally:
            first.stop()

    run(main())


def test_idle_wait_costs_little_cpu():
    """A comm waiting 1 s for a message that never comes uses well under a core (bound: 15 %)."""

    async def main():
        a, b = await C.comm_pair(ADDR)
        pending = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.1)  # past the spin phase
        c0, w0 = time.process_time(), time.monotonic()
        await asyncio.sleep(1.0)
        cpu = (time.process_time() - c0) / (time.monotonic() - w0)
        a.abort()
        with pytest.raises(CommClosedError):
            await pending
        return cpu

    cpu = run(main())
    assert cpu < 0.15, f"idle read used {cpu:.1%} of a core"


def test_many_unreceived_writes_then_reads_in_order():
    """A burst of writes the peer has not read yet (their sends stay pending) arrives complete and in order."""

    async def main():
        a, b = await C.comm_pair(ADDR)
        for i in range(3000):
            await a.write({"i": i, "pad": b"x" * (i % 97)})
        assert len(a._chan.sends) <= max(16, 2 * 3000)
        for i in range(3000):
            got = await b.read()
            assert got["i"] == i and got["pad"] == b"x" * (i % 97)
        await a.close()
        await b.close()

    run(main())


def test_no_inline_spin_towards_this_process():
    """A peer in this process (here: on this very loop) cannot answer while a read spins, so none is tried."""

    async def main():
        before = B.set_spin(inline_us=50)
        try:
            a, b = await C.comm_pair(ADDR)
            for i in range(5):
                await a.write(i)
                assert await b.read() == i
                await b.write(-i)
                assert await a.read() == -i
            assert a._spin_fail == 0 and b._spin_fail == 0
            await a.close()
            await b.close()
        finally:
            B.set_spin(poll_us=before[0], inline_us=before[1])

    run(main())


def test_set_spin_rejects_bad_values():
    with pytest.raises(ValueError, match="inline_us=-1 must be between 0 and 1e6"):
        B.set_spin(inline_us=-1)


def test_plain_message_fast_paths_match_dask_protocol():
    """write/read skip Dask's protocol set-up for messages of msgpack's own types; the frames and the decoded
    messages must be exactly Dask's, and anything else (Serialize, sets, arrays) must take Dask's path."""
    from distributed import protocol
    from distributed.protocol import to_serialize

    plain = [b"x", b"", "text", 7, -2**63, 2.5, None, True, [1, (2, 3)], {"op": "compute", "keys": ["a", ("b", 1)],
             "nested": {"x": [b"\0" * 100, {"y": None}]}}, {1: "int key"}, ("tuple", b"bytes")]
    for msg in plain:
        frames = B._plain_frames(msg)
        assert frames == protocol.dumps(msg), msg
        assert B._plain_loads(frames[0]) == protocol.loads(frames), msg
    for msg in [{1, 2}, {"x": to_serialize(np.arange(3))}, np.arange(3), {"s": frozenset([1])}]:
        assert B._plain_frames(msg) is None, msg
    assert B._plain_loads(protocol.dumps({"s": {1, 2}})[0]) == {"s": {1, 2}}  # Dask's own decode hook
    assert B._plain_loads(b"\xc1") is B._NOT_PLAIN  # malformed: Dask's loads raises it
