"""One-process tests of loom.parallel.sequence / offload and loom.models.llama (COMM_WORLD of size 1)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from loom.comm import world
from loom.models.llama import Llama, LlamaConfig, chunked_lm_loss, chunked_map
from loom.parallel.offload import HostPool, MemoryTracker, reset_transfer_stats, transfer_stats
from loom.parallel.sequence import check_sizes, fpdt_attention, ulysses_attention

TOL = 1e-10


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


@pytest.mark.parametrize("kernel", ["flash", "torch"])
def test_fpdt_single_rank_exact(kernel, monkeypatch):
    from loom.parallel import blocks

    monkeypatch.setenv("LOOM_ATTN_KERNEL", kernel)
    monkeypatch.setattr(blocks, "TILE", 5)  # blocks of 12 and 4 tokens: several tiles, an uneven last one
    comm = world()
    g = torch.Generator().manual_seed(7)
    for causal, hk, chunks, offload in itertools.product((True, False), (4, 2, 1), (1, 3), (False, True)):
        q = torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 12, hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 12, hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
        go = torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64)
        ref = _sdpa(q, k, v, causal)
        want = torch.autograd.grad(ref, (q, k, v), go)
        out = fpdt_attention(q, k, v, comm, chunks=chunks, causal=causal, offload=offload)
        got = torch.autograd.grad(out, (q, k, v), go)
        assert (out - ref).abs().max() <= TOL
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= TOL
        uly = ulysses_attention(q, k, v, comm, causal=causal)
        assert (uly - ref).abs().max() <= TOL


def test_size_errors_name_the_fix():
    q = torch.zeros(1, 10, 4, 2)
    with pytest.raises(ValueError, match="pad to 12"):
        check_sizes(q, q, q, 1, 3)
    with pytest.raises(ValueError, match="kv_heads 3"):
        check_sizes(q, q[:, :, :3], q[:, :, :3], 1, 1)
    with pytest.raises(ValueError, match="sp size 8"):
        check_sizes(torch.zeros(1, 8, 4, 2), torch.zeros(1, 8, 4, 2), torch.zeros(1, 8, 4, 2), 8, 1)


def test_memory_tracker_counts_live_storages():
    with MemoryTracker() as mem:
        a = torch.ones(1 << 18)  # 1 MiB
        b = a * 2
        view = b[10:]
        assert mem.current == 2 << 20
        del a
        assert mem.current == 1 << 20
        c = torch.ones(1 << 17)
        del b, view, c
    assert mem.peak == (2 << 20)
    assert mem.current == 0


def test_host_pool_is_outside_the_tracker():
    reset_transfer_stats()
    pool = HostPool("cpu")
    with MemoryTracker() as mem:
        x = torch.randn(1 << 16)
        h = pool.put(x)
        assert mem.current == x.nbytes  # the host copy is not device memory
        del x
        pool.prefetch(h)
        y = pool.pop(h)
        assert mem.current == y.nbytes
    assert transfer_stats() == {"to_host": y.nbytes, "to_device": y.nbytes}


def test_chunked_loss_and_map_are_exact():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (2, 12), generator=g)
    t[1, 2] = -100
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 30), t.reshape(-1), reduction="sum")
    rg = torch.autograd.grad(ref, (h, w))
    got = chunked_lm_loss(h, w, t, 4)
    gg = torch.autograd.grad(got, (h, w))
    assert abs(got.item() - ref.item()) <= TOL
    assert all((a - b).abs().max() <= TOL for a, b in zip(gg, rg))
    y = chunked_map(lambda i, xc: torch.tanh(xc @ w.t()), h, 3, [w])
    assert torch.allclose(y, torch.tanh(h @ w.t()), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="loss_chunks=5"):
        chunked_lm_loss(h, w, t, 5)


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
def test_llama_config_validation_and_modes_agree(ffn):
    with pytest.raises(ValueError, match="valid: none, ulysses, fpdt"):
        LlamaConfig(sequence_parallel="ring")
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(heads=4, kv_heads=3)
    assert LlamaConfig(sequence_parallel="fpdt", chunks=4).loss_chunks == 4
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, 31, (1, 16), generator=g)
    tgt = torch.randint(0, 31, (1, 16), generator=g)
    base = dict(layers=2, hidden=16, heads=4, kv_heads=2, vocab=31, ffn=ffn)
    losses = []
    for kw in (dict(), dict(sequence_parallel="fpdt", chunks=4, offload=True), dict(ffn_chunks=2, checkpoint=True)):
        m = Llama(LlamaConfig(**base, **kw)).double()
        loss = m.loss(tok, tgt)
        loss.backward()
        losses.append((loss.item(), m.embed.weight.grad.clone()))
    for loss, grad in losses[1:]:
        assert abs(loss - losses[0][0]) <= TOL
        assert (grad - losses[0][1]).abs().max() <= TOL


def test_bench_seqlen_equal_length_fits_every_layout():
    """Ulysses' longest length (searched 16 tokens per rank at a time) need not split into FPDT's chunks:
    9792 tokens on 4 ranks is 2448 per rank, not whole 64-token chunks. The side-by-side timing runs at a
    length both layouts take, so any shape finishes."""
    from loom.bench.seqlen import STEPS, _config, equal_length, parser

    args = parser().parse_args(["--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "8",
                                "--vocab", "7936"])
    for p, seq in [(4, 9792), (4, 64), (2, 1000), (3, 5000)]:
        eq = equal_length(seq, args, p, [STEPS[0], STEPS[-1]])
        assert eq <= max(seq, p * args.chunk) and eq % (p * args.chunk) == 0, (p, seq, eq)
        for step in (STEPS[0], STEPS[-1]):
            cfg = _config(step, args, eq, p)
            s_local = eq // p
            assert s_local % cfg.chunks == 0 and s_local % cfg.ffn_chunks == 0 and s_local % cfg.loss_chunks == 0


def test_pinned_cache_reuses_buffers_across_steps():
    """The CUDA host pool's pinned buffers (here plain host tensors): a second step of the same chunk sizes
    allocates nothing and waits on the event of each buffer's last copy; a new sequence length evicts the old
    sizes, so the cache never holds more than one step's bytes."""
    from loom.parallel.offload import PinnedCache

    cache = PinnedCache(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    waited = []

    def step(sizes, tag):
        bufs = [cache.take(n, waited.append) for n in sizes]
        for i, b in enumerate(bufs):
            cache.give(b, f"{tag}{i}")

    step([100, 100, 40], "a")
    assert cache.allocated == 3 and cache.cached == 240 and cache.in_use == 0
    step([100, 100, 40], "b")
    assert cache.allocated == 3 and sorted(waited) == ["a0", "a1", "a2"]
    step([300, 60], "c")  # a new length: the old sizes make room
    assert cache.allocated == 5 and cache.cached <= cache.high == 360
    step([300, 60], "d")
    assert cache.allocated == 5 and cache.cached + cache.in_use <= cache.high


class _Recording(HostPool):
    """A host pool that logs its calls: ``("put" | "prefetch" | "get", handle, already back on the device)``."""

    def __init__(self, device):
        super().__init__(device)
        self.log: list[tuple[str, int, bool]] = []
        self._inside_get = False

    def put(self, t):
        h = super().put(t)
        self.log.append(("put", h, False))
        return h

    def prefetch(self, h):
        if not self._inside_get:
            self.log.append(("prefetch", h, h in self._ready))
        super().prefetch(h)

    def get(self, h):
        self.log.append(("get", h, h in self._ready))
        self._inside_get = True  # HostPool.get starts the copy itself when nothing was prefetched
        try:
            return super().get(h)
        finally:
            self._inside_get = False


@pytest.mark.parametrize("mode", [dict(), dict(sequence_parallel="ulysses"),
                                  dict(sequence_parallel="fpdt", chunks=2, offload=False)])
def test_checkpoints_on_the_host_are_exact_and_come_back_one_block_ahead(mode, monkeypatch):
    """``offload_checkpoints``: loss and gradients bit for bit those of recompute on the device (fp64); every
    block input goes to the host once in forward, and in backward each block's input is already on its way
    back (prefetched while the block after it recomputed) when its own backward asks for it."""
    import loom.models.llama as llama

    g = torch.Generator().manual_seed(2)
    tok = torch.randint(0, 31, (2, 16), generator=g)
    tgt = torch.randint(0, 31, (2, 16), generator=g)
    base = dict(layers=4, hidden=16, heads=4, kv_heads=2, vocab=31, checkpoint=True, **mode)
    pools: list[_Recording] = []
    real = llama.chunk_store

    def store(offload, device):
        if not offload:
            return real(offload, device)
        pools.append(_Recording(device))
        return pools[-1]

    monkeypatch.setattr(llama, "chunk_store", store)
    got = []
    for on_host in (False, True):
        m = Llama(LlamaConfig(**base, offload_checkpoints=on_host)).double()
        loss = m.loss(tok, tgt)
        got.append((loss.detach(), torch.autograd.grad(loss, list(m.parameters()))))
    assert torch.equal(got[0][0], got[1][0])
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))
    assert len(pools) == 1  # one pool for the model's checkpoints (FPDT's chunks stay on the device here)
    log = pools[0].log
    puts = [h for op, h, _ in log if op == "put"]
    assert len(puts) == 4
    backward = log[len(puts):]
    want = []
    for i in reversed(range(4)):  # block i's input comes back (prefetched unless it is the last block's)...
        want.append(("get", puts[i], i < 3))
        if i:  # ... and block i-1's starts back before block i recomputes
            want.append(("prefetch", puts[i - 1], False))
    assert backward == want, backward
