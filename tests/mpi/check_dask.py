"""mpi:// across ranks: every rank listens, connects to every rank (itself included), closes, refuses.

Run by tests/integration/test_dask.py at 2 and 3 ranks. Each check is one asyncio loop per rank; addresses
are exchanged with a blocking allgather before any rank needs another's loop to serve it, and each rank
leaves its loop only after its own clients finished *and* it served every connection it expects.
"""

from __future__ import annotations

import asyncio

import numpy as np
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize

from loom.dask import backend as B
from loom.dask import connection
from loom.testing import mpi_checks

CLIENTS = 3  # concurrent connections from each rank to each rank
_CONNECT_WORDS = 8  # a message the size of a CONNECT request


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 90))


def check_ping_pong_all_pairs(comm):
    """Fp64 payloads (inline and split frames) to every rank, echoed back bit-exact; counts add up."""
    connection.CHUNK_BYTES = 1 << 18  # 2 MB arrays below travel as several MPI messages per frame

    async def main():
        served: list[int] = []
        all_served = asyncio.Event()
        expected = comm.size * CLIENTS

        async def echo(c):
            try:
                msg = await c.read()
                assert msg["from"] != -1
                await c.write({"x": to_serialize(msg["x"] * 2), "from": comm.rank})
                await c.read()  # the client closes: CommClosedError
            except CommClosedError:
                pass
            finally:
                served.append(1)
                if len(served) == expected:
                    all_served.set()
                await c.close()

        listener = await listen("mpi://", echo)
        addresses = comm.allgather_object(listener.contact_address)
        assert len(set(addresses)) == comm.size

        async def client(peer: int, k: int):
            rng = np.random.default_rng(1000 * comm.rank + 10 * peer + k)
            x = rng.standard_normal((10, 5, 250_000)[k % 3])
            c = await connect(addresses[peer], timeout=30)
            assert c.peer_address == addresses[peer]
            assert B.parse_mpi_address(c.local_address)[1] == comm.rank
            await c.write({"x": to_serialize(x), "from": comm.rank})
            reply = await c.read()
            assert reply["from"] == peer and np.array_equal(reply["x"], x * 2)
            await c.close()

        await asyncio.gather(*(client(p, k) for p in range(comm.size) for k in range(CLIENTS)))
        await asyncio.wait_for(all_served.wait(), 60)
        listener.stop()

    _run(main())
    connection.CHUNK_BYTES = 512 << 20


def check_close_reaches_other_rank(comm):
    """Rank r connects to r+1; the client aborts while the server's read is pending: the server raises."""

    async def main():
        outcome: asyncio.Future = asyncio.get_running_loop().create_future()

        async def server(c):
            try:
                await c.read()
                outcome.set_result("message")
            except CommClosedError:
                outcome.set_result("closed" if c.closed() else "not-closed")

        listener = await listen("mpi://", server)
        addresses = comm.allgather_object(listener.contact_address)
        c = await connect(addresses[(comm.rank + 1) % comm.size], timeout=30)
        await asyncio.sleep(0.05)
        c.abort()
        assert await asyncio.wait_for(outcome, 30) == "closed"
        try:
            await c.write({"after": "abort"})
        except CommClosedError:
            pass
        else:
            raise AssertionError("write after abort did not raise")
        listener.stop()

    _run(main())


def check_refused_on_other_rank(comm):
    """A port nobody listens on, on another rank that does listen: ConnectionRefusedError, not a hang."""

    async def main():
        listener = await listen("mpi://", lambda c: None)
        addresses = comm.allgather_object(listener.contact_address)
        host, rank, _ = B.parse_mpi_address(addresses[(comm.rank + 1) % comm.size])
        try:
            await B.MPIConnector().connect(f"{host}/{rank}/987654")
        except ConnectionRefusedError:
            pass
        else:
            raise AssertionError("connect to a missing port succeeded")
        await asyncio.sleep(0.2)  # let the peer's dispatcher answer the others before the listener stops
        listener.stop()

    _run(main())


def check_inline_spin_backs_off(comm):
    """Reads right after a write spin inline for the reply. Rank 0 is a client of rank 1 (a loop spinning in
    its own read could not serve, so rank 1 only serves; the other ranks talk to themselves, where no spin is
    ever tried, and then sleep, so the pair keeps the cores). Replies 5 ms late make the comm skip ever more
    spins; prompt replies make a spin succeed again (its failure count back to 0). Every reply arrives."""
    before = B.set_spin(inline_us=500)
    partner = 1 if comm.rank == 0 and comm.size > 1 else comm.rank

    async def main():
        slow = asyncio.Event()
        done = asyncio.Event()

        async def echo(c):
            try:
                while True:
                    msg = await c.read()
                    if msg == "slow":
                        slow.set()
                    elif msg == "fast":
                        slow.clear()
                    elif slow.is_set():
                        await asyncio.sleep(0.005)
                    await c.write(msg)
            except CommClosedError:
                done.set()

        listener = await listen("mpi://", echo)
        addresses = comm.allgather_object(listener.contact_address)
        if comm.rank != 1 or comm.size == 1:
            c = await connect(addresses[partner], timeout=30)
            await c.write("slow")
            assert await c.read() == "slow"
            for i in range(8):
                await c.write(i)
                assert await c.read() == i
            if partner == comm.rank:
                assert c._spin_fail == 0, c._spin_fail
            else:
                assert c._spin_fail >= 2, c._spin_fail
                await c.write("fast")
                assert await c.read() == "fast"
                # A wide window for the prompt phase: the check is that a spin that can succeed resets the
                # back-off, not how fast a reply comes on a busy machine (a 500 us window missed every reply
                # there, 2000 times in a row).
                B.set_spin(inline_us=50_000)
                reset = False
                for i in range(2000):
                    await c.write(i)
                    assert await c.read() == i
                    reset = reset or c._spin_fail == 0
                assert reset, "no inline spin succeeded in 2000 prompt exchanges"
            await c.close()
        if partner == comm.rank or comm.rank == 1:
            await asyncio.wait_for(done.wait(), 60)
        listener.stop()

    try:
        _run(main())
    finally:
        B.set_spin(poll_us=before[0], inline_us=before[1])
    comm.iallreduce(np.zeros(1)).wait()  # sleeps while it waits (a blocking collective would spin)


def check_doorbell_wakes_sleeping_reader(comm):
    """Rank r pings rank r+1 while every poller's timer is set to 60 s: each reply can only arrive because
    the writer rang the reader's doorbell (a lost ring would hang the check into its timeout). Channels
    between ranks of this host know each other's bell; rings were drained where pollers slept."""
    from loom.comm import doorbell, poller

    assert doorbell.current() is not None, "the mpi:// engine creates this process's doorbell"
    before = B.set_spin(poll_us=0, inline_us=0)

    async def main():
        p = poller()
        cap = p.backoff.max_sleep_s
        p.backoff.max_sleep_s = 60.0
        done = asyncio.Event()

        async def echo(c):
            try:
                while True:
                    msg = await c.read()
                    await asyncio.sleep(0.002)  # the client's poller is asleep by now
                    await c.write(msg)
            except CommClosedError:
                done.set()

        listener = await listen("mpi://", echo)
        addresses = comm.allgather_object(listener.contact_address)
        try:
            c = await connect(addresses[(comm.rank + 1) % comm.size], timeout=30)
            assert c._chan.bell is not None, "a peer on this host has a doorbell"
            for i in range(20):
                await c.write({"i": i, "x": to_serialize(np.full(100_000, i, np.float64))})
                reply = await c.read()
                assert reply["i"] == i and np.array_equal(reply["x"], np.full(100_000, i, np.float64))
            await c.close()
            await asyncio.wait_for(done.wait(), 30)
        finally:
            p.backoff.max_sleep_s = cap
        listener.stop()

    try:
        _run(main())
    finally:
        B.set_spin(poll_us=before[0], inline_us=before[1])
    assert doorbell.current().rings > 0, "no ring reached this process"
    comm.iallreduce(np.zeros(1)).wait()


def check_large_frames_equal_over_mpi_and_tcp(comm):
    """Large payloads echoed by the next rank over mpi:// and over tcp:// come back bit-exact and equal: a
    fp64 array split into shards (distributed.comm.shard forced to 4 MiB on both transports, so mpi:// joins
    the shards in its receive block), an odd-sized one, and an object pickled with out-of-band buffers."""
    import dask

    shard = B.MPIComm.max_shard_size
    B.MPIComm.max_shard_size = 4 << 20

    async def main():
        served: list[int] = []
        all_served = asyncio.Event()

        async def echo(c):
            try:
                msg = await c.read()
                await c.write({k: to_serialize(msg[k]) for k in ("x", "y", "obj")})
                await c.read()
            except CommClosedError:
                pass
            finally:
                served.append(1)
                if len(served) == 2:
                    all_served.set()

        listeners = [await listen("mpi://", echo), await listen("tcp://127.0.0.1", echo)]
        addresses = comm.allgather_object([lst.contact_address for lst in listeners])
        rng = np.random.default_rng(comm.rank)
        x = rng.standard_normal((10 << 20) // 8 + 5)
        y = rng.integers(0, 255, (3 << 20) + 7, dtype=np.uint8)
        obj = [rng.standard_normal(70_000), "text", {"k": rng.integers(0, 9, 300_000)}]
        got = []
        for address in addresses[(comm.rank + 1) % comm.size]:
            c = await connect(address, timeout=30)
            await c.write({"x": to_serialize(x), "y": to_serialize(y), "obj": to_serialize(obj)})
            got.append(await c.read())
            await c.close()
        for r in got:
            assert np.array_equal(r["x"], x) and np.array_equal(r["y"], y)
            assert np.array_equal(r["obj"][0], obj[0]) and r["obj"][1] == "text"
            assert np.array_equal(r["obj"][2]["k"], obj[2]["k"])
        await asyncio.wait_for(all_served.wait(), 60)
        for lst in listeners:
            lst.stop()

    try:
        with dask.config.set({"distributed.comm.shard": "4MiB"}):
            _run(main())
    finally:
        B.MPIComm.max_shard_size = shard


def check_traffic_on_its_own_communicator(comm):
    """mpi:// runs on COMM_WORLD's "dask" duplicate: a world message that carries the backend's control tag
    reaches its receiver instead of the backend's dispatcher, while connections to every rank keep working."""
    eng = B.engine()
    assert eng.comm is comm.sub("dask") and eng.comm.mpi != comm.mpi, "mpi:// is not on its own communicator"
    dest, source = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    stray = comm.isend(np.full(_CONNECT_WORDS, comm.rank, np.uint64), dest, eng.ctrl_tag)

    async def main():
        listener = await listen("mpi://", lambda c: c.close())
        addresses = comm.allgather_object(listener.contact_address)
        c = await connect(addresses[dest], timeout=30)
        await c.close()
        await asyncio.sleep(0.1)  # the dispatcher polls its control tag meanwhile
        got = np.zeros(_CONNECT_WORDS, np.uint64)

        async def recv():
            await comm.irecv(got, source, eng.ctrl_tag)

        try:
            await asyncio.wait_for(recv(), 20)
        except asyncio.TimeoutError:
            raise AssertionError("mpi://'s dispatcher took a world message on its control tag") from None
        assert (got == source).all(), got
        await stray
        comm.allgather_object(None)  # every rank has its message before any listener stops
        listener.stop()

    _run(main())


def check_tags_within_the_mpi_ceiling(comm):
    """Every tag this rank used or will use fits the running MPI's MPI_TAG_UB (LOOM_TAG_UB may force it down)."""
    import os

    eng = B.engine()
    ub = comm.tag_ub
    forced = os.environ.get("LOOM_TAG_UB")
    if forced:
        assert ub == min(int(forced), ub) and ub <= int(forced), (ub, forced)
    assert eng.ctrl_tag >= 1 and eng.last_tag <= ub, (eng.ctrl_tag, eng.last_tag, ub)
    assert eng._next_tag - 1 <= ub and all(t + 1 <= ub for t in eng.known), (eng._next_tag, ub)


if __name__ == "__main__":
    B.start()  # as loom's Dask entry points do: mpi:// on its own duplicate of COMM_WORLD
    mpi_checks(globals())
