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
from loom.dask import connection  # noqa: E402
from loom.dask import frames as frames_mod  # noqa: E402
from loom.dask import wire  # noqa: E402
from loom.dask import conformance as C  # noqa: E402

ADDR = "mpi://"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_entry_point_registers_mpi_scheme():
    assert isinstance(get_backend("mpi"), B.MPIBackend)


@pytest.mark.parametrize("check", C.ADDRESS_CHECKS, ids=lambda check: check.__name__)
def test_conformance_check(check):
    run(check(ADDR))


def test_client_server_explicit_host_and_rank():
    eng = B.engine()
    run(C.check_client_server(f"mpi://{eng.host}/{eng.rank}", check_listen=lambda loc: loc.startswith(eng.host)))


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


def test_idle_read_sleeps_instead_of_spinning():
    """A read waiting 1 s for a message that never comes sleeps: its loop's poller takes at most ~1.5 sleeps
    per timer period (the back-off cap) and about one to three poll passes per sleep, not the hundreds of
    thousands of passes a second of a spinning wait. Counts of the mechanism, not CPU time: a busy machine
    only lowers them."""
    from loom.comm import poller

    async def main():
        a, b = await C.comm_pair(ADDR)
        pending = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.1)  # past the spin phase
        p = poller()
        p0, s0, t0 = p.passes, p.sleeps, time.monotonic()
        await asyncio.sleep(1.0)
        dt = time.monotonic() - t0
        counts = (p.passes - p0, p.sleeps - s0, dt, p.backoff.max_sleep_s)
        a.abort()
        with pytest.raises(CommClosedError):
            await pending
        return counts

    passes, sleeps, dt, cap = run(main())
    assert sleeps >= 1, "the waiting read never slept"
    assert sleeps / dt <= 1.5 / cap, f"{sleeps / dt:.0f} wake-ups/s with a {cap * 1e3:.1f} ms timer"
    assert passes <= 3 * sleeps + 10, f"{passes} poll passes for {sleeps} sleeps: the wait spins"


def test_many_unreceived_writes_then_reads_in_order():
    """A burst of writes the peer has not read yet arrives complete and in order; the comm keeps only sends
    still in flight (at most twice those, plus the first 16) however many it wrote."""

    async def main():
        a, b = await C.comm_pair(ADDR)
        for i in range(3000):
            await a.write({"i": i, "pad": b"x" * (i % 97)})
            sends = a._chan.sends
            in_flight = sum(not r.test() for r in sends)
            assert len(sends) <= 2 * in_flight + 16, (i, len(sends), in_flight)
        for i in range(3000):
            got = await b.read()
            assert got["i"] == i and got["pad"] == b"x" * (i % 97)
        await a.close()
        await b.close()

    run(main())


def test_prune_keeps_only_sends_in_flight():
    """The pruning itself, on requests that complete at once: 3000 appended, a handful kept."""

    class Done:
        def test(self):
            return True

    class InFlight:
        def test(self):
            return False

    async def main():
        a, b = await C.comm_pair(ADDR)
        chan = a._chan
        for i in range(3000):
            chan.sends.append(InFlight() if i % 1000 == 0 else Done())
            chan.prune()
        assert len(chan.sends) <= 2 * 3 + 16, len(chan.sends)
        chan.sends = []
        await a.close()
        await b.close()

    run(main())


def test_dropped_comm_finaliser_takes_no_lock_and_makes_no_mpi_call():
    """A comm dropped unclosed is freed by the garbage collector, which may run while this thread holds the
    engine's (non-reentrant) lock: its finaliser must only queue the channel. The engine's next tidy sends
    the CLOSE, and the peer's read then raises."""
    import gc
    import threading

    eng = B.engine()

    async def main():
        a, b = await C.comm_pair(ADDR)
        chan = a._chan
        del a
        outcome = []

        def collect_holding_lock():
            with eng.lock:
                calls = []
                real = eng.comm
                eng.comm = type("Spy", (), {"__getattr__": lambda self, n: calls.append(n) or getattr(real, n)})()
                try:
                    gc.collect()
                finally:
                    eng.comm = real
                outcome.append(calls)

        t = threading.Thread(target=collect_holding_lock, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the finaliser waited for the engine lock (deadlock)"
        assert outcome == [[]], f"MPI calls from the finaliser: {outcome}"
        assert chan in eng.dropped and not chan.closed
        eng.tidy()
        assert chan.closed
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(b.read(), 30)
        await b.close()

    run(main())


def test_tags_of_finished_connections_are_reused():
    """300 connections opened and closed one after another: the map of tags in use stays small and the
    tag counter does not run on (a 32767 ceiling leaves 8191 pairs)."""

    async def main():
        eng = B.engine()
        for _ in range(3):  # settle: earlier tests' channels finish draining
            eng.tidy()
        known0, next0 = len(eng.known), eng._next_tag
        for i in range(300):
            a, b = await C.comm_pair(ADDR)
            await a.write(i)
            assert await b.read() == i
            await a.close()
            with pytest.raises(CommClosedError):
                await b.read()
            await b.close()
            eng.tidy()
        assert len(eng.known) <= known0 + 8, (known0, len(eng.known))
        assert (eng._next_tag - next0) // 2 <= 16, (eng._next_tag - next0) // 2

    run(main())


def test_tag_window_fits_the_mpi_ceiling():
    assert B.tag_window(2**29 - 1) == (2**24, 2**28 - 1)
    assert B.tag_window(2**23 - 1) == (2**22, 2**23 - 1)
    assert B.tag_window(32767) == (16384, 32767)
    with pytest.raises(ValueError, match="MPI_TAG_UB=100 leaves the mpi:// backend"):
        B.tag_window(100)
    eng = B.engine()
    assert eng.ctrl_tag >= 1 and eng.last_tag <= eng.comm.tag_ub


@pytest.mark.parametrize("ceiling", [2**23 - 1, 32767])
def test_conformance_under_forced_tag_ceiling(ceiling):
    """Distributed's generic comm checks, in a fresh process whose tag ceiling is forced down (LOOM_TAG_UB):
    every tag the backend uses stays within it."""
    import os
    import subprocess
    import sys

    code = ("import asyncio; from loom.dask import conformance as C, backend as B; "
            "e = B.engine(); assert e.last_tag <= %d, e.last_tag; "
            "print('DONE', asyncio.run(C.run_all('mpi://', missing='mpi://0/999999'))); "
            "assert e.last_tag <= %d and max(e.known, default=0) + 1 <= %d" % (ceiling, ceiling, ceiling))
    env = {**os.environ, "LOOM_TAG_UB": str(ceiling), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dead_peer_closes_reads_and_writes():
    """A channel whose peer died (as the liveness watcher marks it): the pending read and later writes raise
    CommClosedError, as over TCP after the peer's process vanished."""

    async def main():
        a, b = await C.comm_pair(ADDR)
        await a.write("before")
        pending = asyncio.ensure_future(b.read())
        assert await pending == "before"  # what arrived before the death is still delivered
        pending = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.05)
        b._chan.dead = True
        a._chan.dead = True
        with pytest.raises(CommClosedError, match="died"):
            await asyncio.wait_for(pending, 30)
        with pytest.raises(CommClosedError, match="died"):
            await a.write("after")

    run(main())


def test_liveness_watcher_sees_a_process_exit():
    import subprocess
    import threading

    from loom.dask.liveness import Watcher

    seen = threading.Event()
    w = Watcher(lambda rank: seen.set() if rank == 7 else None)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert w.watch(7, proc.pid)
        assert 7 not in w.dead
        proc.kill()
        proc.wait()
        assert seen.wait(30), "the watcher did not report the exit"
        assert 7 in w.dead
    finally:
        proc.kill()


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
        frames, arrays = frames_mod.dumps_arrays(msg)
        assert frames == protocol.dumps(msg) and not arrays, msg
        assert frames_mod.loads_plain(frames[0]) == protocol.loads(frames), msg
    for msg in [{1, 2}, {"x": to_serialize(np.arange(3, dtype=object))}, np.arange(3), {"s": frozenset([1])},
                {"x": to_serialize(np.arange(6.0)[::2])}, {"x": to_serialize([1, 2])}]:
        assert frames_mod.dumps_arrays(msg) is None, msg
    assert frames_mod.loads_plain(protocol.dumps({"s": {1, 2}})[0]) == {"s": {1, 2}}  # Dask's own decode hook
    one = protocol.dumps({"op": "x"})[0]
    # Malformed, truncated, or with bytes after the object: Dask's loads raises it; the next frame still decodes.
    for bad in (b"\xc1", one[:-1], one + b"\x01", b""):
        assert frames_mod.loads_plain(bad) is frames_mod.NOT_PLAIN, bad
        assert frames_mod.loads_plain(one) == {"op": "x"}
    big = {"x": b"\1" * (frames_mod.UNPACK_MAX + 1), "l": [1]}  # past the reused unpacker's size
    assert frames_mod.loads_plain(protocol.dumps(big)[0]) == protocol.loads(protocol.dumps(big))
    assert frames_mod.loads_plain(one + b"\x01" * frames_mod.UNPACK_MAX) is frames_mod.NOT_PLAIN


_ARRAYS = [np.arange(12.0).reshape(3, 4), np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
           np.array(3.5), np.zeros((0, 5), np.complex128), np.array(["ab", "c"]), np.array([b"xy"]),
           np.arange(4).astype("datetime64[ns]"), np.array([True, False]), np.arange(5, dtype=">u4"),
           np.arange(10.0)[2:7], np.arange(12).reshape(3, 4)[:, :1].copy(order="F")]


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("deserialize", [True, False])
def test_numpy_arrays_framed_directly_read_back_as_dask_reads_them(deserialize, inline, monkeypatch):
    """dumps_arrays/loads_arrays against Dask's protocol.dumps/loads: the same arrays (dtype, shape, memory
    order, values, writeable), built over the received frames without a copy (or, up to INLINE_ARRAY_MAX,
    carried inside the msgpack frame); not deserialising gives Dask's Serialized, which deserialises to the same
    array."""
    from distributed import protocol
    from distributed.protocol import to_serialize
    from distributed.protocol.serialize import Serialized, deserialize as dask_deserialize

    monkeypatch.setattr(frames_mod, "INLINE_ARRAY_MAX", 1 << 20 if inline else -1)
    ro = np.arange(3.0)
    ro.flags.writeable = False
    arrays = [*_ARRAYS, ro]
    msg = {"op": "get_data", "data": {f"k{i}": to_serialize(a) for i, a in enumerate(arrays)}, "l": [1, (2,)]}
    frames, has_arrays = frames_mod.dumps_arrays(msg)
    assert has_arrays and len(frames) == (1 if inline else 1 + len(arrays))
    received = [frames[0]] + [memoryview(bytearray(f)) for f in frames[1:]]  # as they land in a receive block
    got = frames_mod.loads_arrays(received, deserialize=deserialize)
    want = protocol.loads(protocol.dumps(msg), deserialize=deserialize)
    assert got.keys() == want.keys() and got["l"] == want["l"] == (1, (2,)) and got["op"] == "get_data"
    for i, a in enumerate(arrays):
        g, w = got["data"][f"k{i}"], want["data"][f"k{i}"]
        if not deserialize:
            assert type(g) is type(w) is Serialized
            g, w = dask_deserialize(g.header, g.frames), dask_deserialize(w.header, w.frames)
        elif not inline:
            assert np.shares_memory(g, np.frombuffer(received[i + 1], np.uint8)) or a.size == 0
        for x in (g, w):
            assert x.dtype == a.dtype and x.shape == a.shape and x.strides == a.strides, (i, x.strides)
            assert x.flags.writeable == a.flags.writeable
            np.testing.assert_array_equal(x, a)


def test_framed_arrays_cross_a_comm_inline_and_separate():
    """Through a real comm pair: arrays up to INLINE_ARRAY_MAX ride inside the msgpack frame, larger ones below
    INLINE_MAX in the header, larger ones still and a msgpack frame past INLINE_MAX (long strings) as frames of
    their own; every array reads back equal."""
    from distributed.protocol import to_serialize

    big = np.random.default_rng(5).standard_normal(wire.INLINE_MAX // 4)  # 2x INLINE_MAX bytes
    mid = np.arange(frames_mod.INLINE_ARRAY_MAX // 4, dtype=np.float64)  # 2x INLINE_ARRAY_MAX: in the header
    assert frames_mod.INLINE_ARRAY_MAX < mid.nbytes < wire.INLINE_MAX
    msgs = [{"data": {f"k{i}": to_serialize(a) for i, a in enumerate([*_ARRAYS, mid, big])}},
            {"text": "t" * (wire.INLINE_MAX + 1), "x": to_serialize(_ARRAYS[1]), "y": to_serialize(big)},
            {"data": {"small": to_serialize(_ARRAYS[0])}}]  # one frame: the backend's one-frame path
    assert all(frames_mod.dumps_arrays(m)[1] for m in msgs)

    async def main():
        a, b = await C.comm_pair(ADDR)
        for m in msgs:
            await a.write(m)
            got = await b.read()
            sent = m["data"] if "data" in m else {"x": m["x"], "y": m["y"]}
            for k, v in sent.items():
                g = got["data"][k] if "data" in m else got[k]
                assert g.dtype == v.data.dtype and g.strides == v.data.strides, k
                np.testing.assert_array_equal(g, v.data)
            assert "data" in m or got["text"] == m["text"]
        await a.close()
        await b.close()

    run(main())


def test_array_framing_reuses_a_packer_per_thread_safely():
    """dumps_arrays and loads_plain keep one msgpack packer and unpacker per thread: a failed pack leaves no bytes
    behind for the next, the frame list is not kept past the call, and threads packing and unpacking at once each
    get their own message back."""
    import msgpack
    from distributed.protocol import to_serialize

    from loom.testing import race

    plain = ([protocol_dumps({"a": b"x"})[0]], False)
    assert frames_mod.dumps_arrays({"s": {1}}) is None  # fails inside the packer
    assert frames_mod.dumps_arrays({"a": b"x"}) == plain
    big, small = np.arange(4000.0), np.arange(5.0)  # one framed apart, one inlined in the msgpack frame
    for arrays in ([big], [small], [small, big]):
        bad = {**{f"x{i}": to_serialize(a) for i, a in enumerate(arrays)}, "bad": {2}}
        assert frames_mod.dumps_arrays(bad) is None
        assert frames_mod._PACKERS.frames == [None] and frames_mod._PACKERS.inlined == 0
        assert frames_mod.dumps_arrays({"a": b"x"}) == plain  # nothing left over from the failed pack
    frames, arrays = frames_mod.dumps_arrays({"x": to_serialize(small)})
    assert len(frames) == 1 and arrays is True
    assert frames_mod.dumps_arrays({"a": b"x"}) == plain  # nor from an inlined-only one

    class Interrupt(BaseException):  # as a signal handler's KeyboardInterrupt, raised inside the packer's hook
        pass

    def interrupting(obj):
        raise Interrupt

    packer = frames_mod._PACKERS.arrays
    frames_mod._PACKERS.arrays = msgpack.Packer(use_bin_type=True, default=interrupting)
    frames_mod._PACKERS.frames.append(big)  # as if the hook had met an array before the interrupt
    try:
        with pytest.raises(Interrupt):  # propagated, not taken for a message Dask must frame
            frames_mod.dumps_arrays({"x": to_serialize(big)})
    finally:
        frames_mod._PACKERS.arrays = packer
    assert frames_mod._PACKERS.frames == [None] and frames_mod.dumps_arrays({"a": b"x"}) == plain
    errors: list = []

    def work(k: int) -> None:
        for i in range(300):
            # odd i: an array past INLINE_ARRAY_MAX, in a frame of its own; even i: inside the msgpack frame
            a = np.full(k + 1 + (i % 2) * frames_mod.INLINE_ARRAY_MAX // 4, i, np.int32)
            msg = {"k": k, "i": i, "a": to_serialize(a), "s": "y" * (i % 7)}
            try:
                frames, arrays = frames_mod.dumps_arrays(msg)
                got = frames_mod.loads_arrays([frames[0], *(memoryview(bytearray(f)) for f in frames[1:])])
                ok = arrays and len(frames) == 1 + i % 2 and got["k"] == k and got["i"] == i
                ok = ok and np.array_equal(got["a"], a)
                small = {"k": k, "i": i, "s": "y" * (i % 7)}
                ok = ok and frames_mod.loads_plain(frames_mod.dumps_arrays(small)[0][0]) == small
            except Exception as exc:  # noqa: BLE001 - a shared packer fails here
                ok = repr(exc)
            if ok is not True:
                errors.append((k, i, ok))

    race(work)  # threads switch inside the packer's callback as often as they can
    assert errors == []


def protocol_dumps(msg):
    from distributed import protocol

    return protocol.dumps(msg)


def test_array_messages_fall_back_to_dask_under_compression_or_other_serializers():
    from distributed.protocol import to_serialize

    async def main():
        a, b = await C.comm_pair(ADDR)
        msg = {"x": to_serialize(np.arange(4.0))}
        assert a._serialise_inline(msg, None, "message")[1] is True
        assert a._serialise_inline(msg, ["pickle"], "message")[1] is False
        assert a._serialise_inline({"y": 1}, None, "message") == frames_mod.dumps_arrays({"y": 1})
        a.handshake_options = {**a.handshake_options, "compression": "zlib"}
        assert a._serialise_inline(msg, None, "message")[1] is False
        await a.write(msg)  # Dask's path, compressed or not: read back all the same
        np.testing.assert_array_equal((await b.read())["x"], np.arange(4.0))
        await a.close()
        await b.close()

    run(main())


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def test_split_frame_is_received_into_one_block_and_joined_without_a_copy(monkeypatch):
    """A frame above distributed.comm.shard travels as several shards; they land in adjacent slices of one
    receive block, so Dask's merge is a view (merge_memoryviews) and never the copying fallback."""
    import importlib

    S = importlib.import_module("distributed.protocol.serialize")  # the module (the package exports a function)
    merged, copied = [], []
    merge, copy = S.merge_memoryviews, S.host_array_from_buffers
    monkeypatch.setattr(S, "merge_memoryviews", lambda mvs: merged.append(len(mvs)) or merge(mvs))
    monkeypatch.setattr(S, "host_array_from_buffers", lambda bufs: copied.append(len(bufs)) or copy(bufs))
    monkeypatch.setattr(B.MPIComm, "max_shard_size", 1 << 20)

    async def main():
        a, b = await C.comm_pair(ADDR)
        x = np.random.default_rng(5).standard_normal((5 << 20) // 8 + 3)
        y = np.arange(200_000, dtype=np.int32)  # a second host frame in the same message and block
        # The set takes the message through Dask's protocol.dumps (plain arrays alone travel unsplit).
        await a.write({"x": to_serialize(x), "y": to_serialize(y), "s": {1}})
        got = await b.read()
        assert np.array_equal(got["x"], x) and np.array_equal(got["y"], y)
        await a.close()
        await b.close()
        return got

    from distributed.protocol import to_serialize

    got = run(main())
    assert max(merged) >= 5, f"the 5 MiB frame was not split into 1 MiB shards: {merged}"
    assert copied == [], "the shards were copied into a new buffer instead of joined in place"
    lo_x, lo_y = _address(got["x"]), _address(got["y"])
    assert lo_y - lo_x == got["x"].nbytes, "the frames of one message are not adjacent slices of one block"


def test_receive_blocks_are_reused_only_once_nothing_refers_to_them():
    """Large received frames come from recycled blocks: a block held by a live array (even a slice of it) is
    never handed out again; once every view is gone the next message of that size lands in it."""
    pool = frames_mod.POOL

    async def main():
        a, b = await C.comm_pair(ADDR)
        rng = np.random.default_rng(9)
        sent = [rng.standard_normal(3 << 17) for _ in range(3)]  # 3 MiB each: pooled
        await a.write({"x": to_serialize(sent[0])})
        first = (await b.read())["x"]
        keep = first[10:20]  # a slice keeps the block alive after the array is gone
        where = _address(first)
        del first
        await a.write({"x": to_serialize(sent[1])})
        second = (await b.read())["x"]
        assert _address(second) != where, "a block still referred to was reused"
        assert np.array_equal(keep, sent[0][10:20]) and np.array_equal(second, sent[1])
        del keep, second
        reused = pool.reused
        await a.write({"x": to_serialize(sent[2])})
        third = (await b.read())["x"]
        assert pool.reused > reused and np.array_equal(third, sent[2])
        await a.close()
        await b.close()

    from distributed.protocol import to_serialize

    run(main())


def test_block_pool_sizes_and_capacity():
    pool = frames_mod.BlockPool(capacity=8 << 20, min_bytes=1 << 20)
    small = pool.take(1000)
    assert small.nbytes == 1000 and small.base is None  # below min_bytes: plain numpy, never pooled
    blocks = [pool.take((3 << 20) + 1) for _ in range(4)]  # 3 MiB + 1 -> a 3.5 MiB size class
    assert all(b.nbytes == (3 << 20) + 1 and b.flags.writeable for b in blocks)
    del blocks
    assert pool.held == 7 << 20, "only what fits the capacity is kept (two 3.5 MiB blocks)"
    exact = pool.take(3 << 20)  # exactly 3 MiB is a class of its own: a new block
    assert pool.reused == 0 and exact.nbytes == 3 << 20
    again = pool.take((3 << 20) + 5)
    assert pool.reused == 1 and pool.held == (7 << 20) // 2 and again.nbytes == (3 << 20) + 5
    del again
    assert pool.held == 7 << 20, "a block comes back once its array is gone"



def test_plain_messages_are_packed_inline_whatever_their_size(monkeypatch):
    """A message of msgpack types only is packed as Dask's dumps packs it, inline, never sized first (_copy_cost)
    nor sent to Dask's offload thread, above Dask's offload size (10 MiB) too; it reads back as Dask's loads
    gives it. (Arrays behind to_serialize: test_arrays_that_serialise_as_views_skip_the_offload_thread.)"""
    from distributed import protocol

    calls: list[str] = []
    to_frames = connection.to_frames

    async def counted_to(*args, **kwargs):
        calls.append("to_frames")
        return await to_frames(*args, **kwargs)

    monkeypatch.setattr(connection, "to_frames", counted_to)
    monkeypatch.setattr(connection, "_copy_cost", lambda *args: calls.append("sized") or 0)
    msgs = [b"x", {"op": "get_data", "keys": ("x-1", "y-2"), "who": None, "reply": True},
            [1, 2.5, "s", None, {"t": [1, 2]}], {"blob": b"z" * (12 << 20), "n": 3}, b"w" * (11 << 20)]

    async def main():
        a, b = await C.comm_pair(ADDR)
        for m in msgs:
            assert a._serialise_inline(m, None, "message") == (protocol.dumps(m), False)
            await a.write(m)
            assert await b.read() == protocol.loads(protocol.dumps(m))
        assert calls == []
        await a.close()
        await b.close()

    run(main())


def test_arrays_that_serialise_as_views_skip_the_offload_thread(monkeypatch):
    """Above Dask's offload size (10 MiB) to_frames/from_frames run in a thread; a message whose bulk is numpy
    arrays behind to_serialize is framed and read inline (nothing is copied), anything else still goes through
    the thread, as over TCP."""
    from distributed.protocol import to_serialize

    calls: list[str] = []
    to_frames, from_frames = connection.to_frames, connection.from_frames

    async def counted_to(*args, **kwargs):
        calls.append("to_frames")
        return await to_frames(*args, **kwargs)

    async def counted_from(*args, **kwargs):
        calls.append("from_frames")
        return await from_frames(*args, **kwargs)

    monkeypatch.setattr(connection, "to_frames", counted_to)
    monkeypatch.setattr(connection, "from_frames", counted_from)
    x = np.random.default_rng(3).standard_normal((12 << 20) // 8)
    y = np.random.default_rng(4).standard_normal((24 << 20) // 8)[::2]  # 12 MiB, strided
    assert wire._copy_cost({"op": "get_data", "data": {"k": to_serialize(x)}}) < 1 << 20
    assert wire._copy_cost({"data": {"k": to_serialize(y)}}) > 10 << 20  # strided: Dask copies it
    assert wire._copy_cost({"data": x}) > 10 << 20  # not behind to_serialize: pickled

    async def main():
        a, b = await C.comm_pair(ADDR)
        await a.write({"status": "OK", "data": {"k": to_serialize(x)}})
        got = await b.read()
        assert np.array_equal(got["data"]["k"], x) and calls == []
        await a.write({"x": to_serialize(y)})
        assert np.array_equal((await b.read())["x"], y) and calls == ["to_frames", "from_frames"]
        await a.close()
        await b.close()

    run(main())
