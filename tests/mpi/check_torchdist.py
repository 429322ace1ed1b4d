"""The ``"loom"`` torch.distributed backend against gloo, in one job (2 and 4 ranks).

The default process group is ``init_process_group("loom")`` (no MASTER_ADDR: rank, size and the store come from
MPI); the peer is ``new_group(backend="gloo")`` over the same ranks, so every collective and every training run
sees the same inputs on both. Exact: every collective's result is ``torch.equal`` (bit for bit) to gloo's, on data
whose sums and products are exact in any order (the backends add in different orders at 4 ranks); the training runs,
fp64 on random data, agree to 1e-12 in losses and parameters (the same orders at work).
"""

from __future__ import annotations

import datetime
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import loom  # noqa: F401 - registers the backend
from loom.comm import CollectiveMismatchError
from loom.comm import safety
from loom.testing import mpi_checks

TOL = 1e-12
_STATE: dict = {}


def _groups():
    """(loom group, gloo group) over every rank; made once per job."""
    if not _STATE:
        dist.init_process_group("loom")
        _STATE["gloo"] = dist.new_group(backend="gloo")
    return dist.group.WORLD, _STATE["gloo"]


def _both(fn):
    """``fn(group)`` on loom and gloo; both results."""
    loom_g, gloo_g = _groups()
    return fn(loom_g), fn(gloo_g)


def _same(a, b, what):
    if isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{what}[{i}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), f"{what}: loom {a.flatten()[:6]} != gloo {b.flatten()[:6]}"


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _rand(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:  # multiples of 1/8 below 2: sums and products exact in any order (P <= 4)
        return (torch.randint(-15, 16, shape, generator=gen) / 8).to(dtype)
    return torch.randint(-5, 6, shape, generator=gen).to(dtype)


DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32, torch.bool)
# sizes: a small blocking one, a large one (>= 64 KiB: posted non-blocking, completed by the progress thread), empty
SHAPES = ((3, 4), (96, 128), (0, 4))


def check_all_reduce_every_op_dtype_and_layout_matches_gloo(comm):
    """SUM/MIN/MAX/PRODUCT on every dtype, contiguous and not (a transposed view), small, large and empty."""
    gen = torch.Generator().manual_seed(100 + comm.rank)
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)
    for dtype in DTYPES:
        for shape in SHAPES:
            base = _rand(shape, dtype, gen)
            for op in ops:
                for layout in ("contiguous", "transposed"):
                    def run(g):  # the transposed one asynchronously (the progress thread's path when large)
                        x = base.clone() if layout == "contiguous" else base.t().contiguous().t()
                        _wait(dist.all_reduce(x, op=op, group=g, async_op=layout == "transposed"))
                        return x
                    _same(*_both(run), f"all_reduce {op} {dtype} {shape} {layout}")


def check_pairwise_reductions_match_gloo(comm):
    """Blocking all_reduce and reduce_scatter_tensor on loom.comm's block-exchange path (LOOM_PAIRWISE_BYTES,
    forced here at every size): uneven and empty sizes, every op, AVG, an output written directly and one that
    is not contiguous."""
    from loom.comm import communicator as C

    p = comm.size
    gen = torch.Generator().manual_seed(300 + comm.rank)
    saved, C._PAIRWISE_MIN = C._PAIRWISE_MIN, 0
    try:
        for dtype in (torch.float64, torch.float32, torch.int32):
            for n in (0, 1, p + 1, 4 * p + 3):
                base = _rand((n,), dtype, gen)
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
                    def run(g):
                        x = base.clone()
                        dist.all_reduce(x, op=op, group=g)
                        return x
                    _same(*_both(run), f"all_reduce {op} {dtype} {n}")
            rows = _rand((p * 3, 2), dtype, gen)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                def scatter(g, strided=False):
                    out = torch.zeros(2, 3, dtype=dtype).t() if strided else torch.zeros(3, 2, dtype=dtype)
                    dist.reduce_scatter_tensor(out, rows, op=op, group=g)
                    return out
                _same(*_both(scatter), f"reduce_scatter_tensor {op} {dtype}")
                _same(*_both(lambda g: scatter(g, True)), f"reduce_scatter_tensor {op} {dtype} strided")
        big = _rand((96, 128), torch.float32, gen)  # asked asynchronously: completed on the caller's thread

        def asked_async(g):
            x = big.clone()
            work = dist.all_reduce(x, group=g, async_op=True)
            assert g is not _groups()[0] or work.is_completed()
            work.wait()
            return x
        _same(*_both(asked_async), "all_reduce async_op=True")
        every = [_rand((2 * p + 1,), torch.float64, torch.Generator().manual_seed(9 + r)) for r in range(p)]
        x = every[comm.rank].clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        assert torch.equal(x, sum(every) / p)
    finally:
        C._PAIRWISE_MIN = saved


def check_avg_premul_and_16_bit_floats_are_exact(comm):
    """AVG (gloo has none) is SUM / P; PREMUL_SUM scales first; bf16/fp16 are summed in float32 and rounded once:
    on data whose 16-bit running sum rounds differently (from 3 ranks on: two 16-bit values add exactly in float32,
    so at 2 ranks both ways agree), checked to differ from the 16-bit sum before loom is compared."""
    _groups()
    gen = torch.Generator().manual_seed(7)
    every = [_rand((6, 5), torch.float64, gen) for _ in range(comm.size)]
    x = every[comm.rank].clone()
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    assert torch.equal(x, sum(every) / comm.size)
    wide = [torch.randn(64, generator=gen, dtype=torch.float64) * (1 + 10 * k) for k in range(comm.size)]
    for dtype in (torch.bfloat16, torch.float16):
        y = wide[comm.rank].to(dtype)
        dist.all_reduce(y)
        want = sum(e.to(dtype).float() for e in wide).to(dtype)  # float32, rounded once
        running = wide[0].to(dtype)
        for e in wide[1:]:
            running = running + e.to(dtype)  # rounded at every addition
        assert comm.size < 3 or not torch.equal(running, want), f"{dtype}: data must tell a 16-bit sum apart"
        assert torch.equal(y, want), (dtype, (y.float() - want.float()).abs().max())
    z = every[comm.rank].clone()
    dist.all_reduce(z, op=dist._make_nccl_premul_sum(0.5))
    assert torch.equal(z, sum(e * 0.5 for e in every))


def check_gathers_scatters_and_all_to_all_match_gloo(comm):
    """all_gather, all_gather_into_tensor, reduce_scatter(_tensor), even all_to_all_single and broadcast on three
    dtypes, small (blocking) and large (asynchronously: the progress thread's path), bit for bit as gloo."""
    p, r = comm.size, comm.rank
    gen = torch.Generator().manual_seed(300 + r)
    for dtype in (torch.float64, torch.int32, torch.bool):
        for rows in (2, 200):  # 200 x 64 fp64 = 100 KiB, asynchronously: the progress thread's path
            x = _rand((rows, 64), dtype, gen)
            aop = rows == 200

            def ag(g):
                outs = [torch.empty_like(x) for _ in range(p)]
                _wait(dist.all_gather(outs, x, group=g, async_op=aop))
                return outs
            _same(*_both(ag), f"all_gather {dtype}")

            def agt(g):
                out = torch.empty((p * rows, 64), dtype=dtype)
                _wait(dist.all_gather_into_tensor(out, x.t().contiguous().t(), group=g, async_op=aop))  # non-contiguous
                return out
            _same(*_both(agt), f"all_gather_into_tensor {dtype}")

            if dtype != torch.bool:
                big = _rand((p * rows, 64), dtype, gen)

                def rst(g):
                    out = torch.empty((rows, 64), dtype=dtype)
                    _wait(dist.reduce_scatter_tensor(out, big, group=g, async_op=aop))
                    return out
                _same(*_both(rst), f"reduce_scatter_tensor {dtype}")

                def rs(g):
                    out = torch.empty((rows, 64), dtype=dtype)
                    _wait(dist.reduce_scatter(out, list(big.chunk(p)), group=g, async_op=aop))
                    return out
                _same(*_both(rs), f"reduce_scatter {dtype}")

            def a2a(g):
                out = torch.empty((p * rows, 64), dtype=dtype)
                _wait(dist.all_to_all_single(out, torch.cat([x] * p), group=g, async_op=aop))
                return out
            _same(*_both(a2a), f"all_to_all_single even {dtype}")

            def bc(g):
                y = x.clone()
                dist.broadcast(y, src=p - 1, group=g)
                return y
            _same(*_both(bc), f"broadcast {dtype}")


def check_uneven_all_to_all_rooted_and_coalesced_match_gloo(comm):
    """Uneven all_to_all_single (zero rows included) and all_to_all (unequal sizes: against the expected blocks,
    gloo refuses them), gather, scatter, reduce and all_reduce_coalesced, as gloo."""
    p, r = comm.size, comm.rank
    gen = torch.Generator().manual_seed(400 + r)
    # uneven all_to_all_single: rank r sends (r + j) % 3 + (rows of 1) rows to rank j, including zero rows
    send = [(r + j) % 3 for j in range(p)]
    recv = [(j + r) % 3 for j in range(p)]
    x = torch.randn(sum(send), 5, generator=gen, dtype=torch.float64)

    def uneven(g):
        out = torch.full((sum(recv), 5), float("nan"), dtype=torch.float64)
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=g)
        return out
    _same(*_both(uneven), "all_to_all_single uneven")

    def a2a_list(g):
        ins = [torch.full((j + 1, 2), float(10 * r + j), dtype=torch.float64) for j in range(p)]
        outs = [torch.empty((r + 1, 2), dtype=torch.float64) for _ in range(p)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    loom_out = a2a_list(dist.group.WORLD)  # gloo's all_to_all takes equal sizes only: against the expected blocks
    for j, o in enumerate(loom_out):
        assert torch.equal(o, torch.full((r + 1, 2), float(10 * j + r), dtype=torch.float64)), j

    y = _rand((4, 3), torch.float64, gen)

    def gather(g):
        outs = [torch.empty_like(y) for _ in range(p)] if r == 0 else None
        dist.gather(y, outs, dst=0, group=g)
        return outs or []
    _same(*_both(gather), "gather")

    def scatter(g):
        out = torch.empty_like(y)
        dist.scatter(out, [y + k for k in range(p)] if r == 1 else None, src=1, group=g)
        return out
    _same(*_both(scatter), "scatter")

    def reduce(g):
        z = y.clone()
        dist.reduce(z, dst=1, op=dist.ReduceOp.MAX, group=g)
        return z if r == 1 else y
    _same(*_both(reduce), "reduce")

    def coalesced(g):
        ts = [y.clone(), torch.arange(5, dtype=torch.float64) * r]
        dist.all_reduce_coalesced(ts, group=g)
        return ts
    _same(*_both(coalesced), "all_reduce_coalesced")
    dist.barrier()


def check_send_recv_and_recv_from_any_source(comm):
    """A ring of send/recv (small and large), isend/irecv, and rank 0 receiving from whoever sends first."""
    _groups()
    p, r = comm.size, comm.rank
    for n in (3, 20000):
        x = torch.arange(n, dtype=torch.float64) + 1000 * r
        out = torch.empty(n, dtype=torch.float64)
        reqs = [dist.isend(x, (r + 1) % p), dist.irecv(out, (r - 1) % p)]
        for q in reqs:
            q.wait()
        assert torch.equal(out, torch.arange(n, dtype=torch.float64) + 1000 * ((r - 1) % p))
        back = torch.empty(n, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, x, (r - 1) % p), dist.P2POp(dist.irecv, back, (r + 1) % p)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        assert torch.equal(back, torch.arange(n, dtype=torch.float64) + 1000 * ((r + 1) % p))
    if r == 0:
        got = set()
        for _ in range(p - 1):
            buf = torch.empty(2, dtype=torch.int64)
            src = dist.recv(buf, tag=5)
            assert buf.tolist() == [src, src * src], (src, buf)
            got.add(src)
        assert got == set(range(1, p))
    else:
        dist.send(torch.tensor([r, r * r]), 0, tag=5)
    dist.barrier()


def check_async_work_progresses_while_the_caller_computes(comm):
    """A large allreduce with async_op=True completes while this thread only computes (no MPI call, no wait):
    the progress thread moved it. Then its future and wait() give the reduced tensor in place."""
    _groups()
    x = torch.full((1 << 18,), float(comm.rank + 1), dtype=torch.float64)  # 2 MiB
    work = dist.all_reduce(x, async_op=True)
    a = torch.randn(128, 128, dtype=torch.float64)
    for _ in range(20000):
        a = torch.tanh(a @ a * 1e-3)
        if work.is_completed():
            break
    assert work.is_completed(), "the allreduce did not complete while the caller computed"
    work.wait()
    assert torch.equal(x, torch.full_like(x, comm.size * (comm.size + 1) / 2))
    fut = dist.all_reduce(x, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full_like(x, comm.size * comm.size * (comm.size + 1) / 2))


# ---------------------------------------------------------------------------------------------- training runs
def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(rank: int, steps: int, n: int = 6):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(n, 8, generator=gen, dtype=torch.float64), torch.randn(n, 4, generator=gen,
                                                                                dtype=torch.float64))
            for _ in range(steps)]


def _close(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        # a Python float is an fp64 loss (.item()): as_tensor alone would round it to float32
        x, y = (torch.tensor(v, dtype=torch.float64) if isinstance(v, float) else torch.as_tensor(v) for v in (x, y))
        err = (x - y).abs().max().item() if x.numel() else 0.0
        assert err <= TOL, f"{what}[{i}]: loom and gloo differ by {err:.3e} > {TOL}"


def _params(model):
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().clone())
    return out


def _train(model, batches, opt=None):
    """One step of ``opt`` (default SGD, lr 0.1) per batch on the squared error; the losses (floats) and the
    final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if opt is None else opt
    losses = []
    for x, y in batches:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _params(model)


def check_ddp_matches_gloo_with_and_without_no_sync(comm):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(comm.rank, 6)

    def run(g):
        model = DDP(_mlp(0), process_group=g, bucket_cap_mb=0.001)  # several buckets
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(0, len(batches), 2):
            for i, (x, y) in enumerate(batches[step:step + 2]):
                ctx = model.no_sync() if i == 0 and step >= 2 else _nullctx()
                with ctx:
                    loss = ((model(x) - y) ** 2).mean()
                    loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses, _params(model)

    (la, pa), (lb, pb) = _both(run)
    _close(la, lb, "ddp loss")
    _close(pa, pb, "ddp params")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _mesh(shape, names, backend):
    """A DeviceMesh over every rank on ``backend``. The gloo mesh's dims get other names: DTensor caches its
    redistribution plans by mesh, and meshes of equal shape and names compare equal whatever their groups, so
    the gloo run would reuse the loom mesh's groups (and compare loom with itself)."""
    from torch.distributed.device_mesh import init_device_mesh

    if backend == "loom":
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    names = tuple(f"{n}_gloo" for n in names)
    return init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override={n: "gloo" for n in names})


def check_fsdp2_matches_gloo(comm):
    """fully_shard on two layers (reshard_after_forward True on one, False on the other, then swapped) plus the
    root, whose group holds the last layer, not sharded on its own; 3 steps of Adam."""
    from torch.distributed.fsdp import fully_shard

    _groups()
    batches = _batches(comm.rank, 3)
    for reshard in (True, False):
        def run(backend):
            mesh = _mesh((comm.size,), ("dp",), backend)
            model = _mlp(1)
            fully_shard(model[0], mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model[2], mesh=mesh, reshard_after_forward=not reshard)
            fully_shard(model, mesh=mesh)
            return _train(model, batches, torch.optim.Adam(model.parameters(), lr=1e-2))

        (la, pa), (lb, pb) = run("loom"), run("gloo")
        _close(la, lb, f"fsdp2 loss reshard={reshard}")
        _close(pa, pb, f"fsdp2 params reshard={reshard}")


def check_dtensor_tp_on_a_2d_mesh_matches_gloo(comm):
    """ColwiseParallel / RowwiseParallel on tp, gradients averaged over dp by fully_shard, dp x tp = P/2 x 2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _groups()
    dp = comm.size // 2
    batches = _batches(comm.rank // 2, 3)  # tp peers see the same batch

    def run(backend):
        mesh = _mesh((dp, 2), ("dp", "tp"), backend)
        model = _mlp(2)
        parallelize_module(model, mesh[mesh.mesh_dim_names[1]], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh[mesh.mesh_dim_names[0]])
        return _train(model, batches)

    (la, pa), (lb, pb) = run("loom"), run("gloo")
    _close(la, lb, "tp loss")
    _close(pa, pb, "tp params")
    # and both against one process: the same model on every dp shard's batch, the gradients averaged
    ref = _mlp(2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    shards = [_batches(i, 3) for i in range(dp)]
    want = []
    for step in range(3):
        for i in range(dp):
            x, y = shards[i][step]
            loss = ((ref(x) - y) ** 2).mean() / dp
            loss.backward()
            if i == comm.rank // 2:
                want.append(loss.detach() * dp)
        opt.step()
        opt.zero_grad()
    _close(la, want, "tp loss vs one process")
    _close(pa, _params(ref), "tp params vs one process")


def check_pipelining_gpipe_and_1f1b_match_gloo(comm):
    """One Linear+Tanh stage per rank, 4 micro-batches, GPipe and 1F1B; the last stage's losses and every
    stage's gradients equal gloo's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _, gloo_g = _groups()
    p, r = comm.size, comm.rank
    x, y = _batches(0, 1, n=8)[0]
    x = x[:, :8]

    def stage_module():
        torch.manual_seed(50 + r)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()

    def loss_fn(out, target):
        return ((out - target[:, :1].expand_as(out)) ** 2).mean()

    for schedule in (ScheduleGPipe, Schedule1F1B):
        def run(g):
            mod = stage_module()
            stage = PipelineStage(mod, r, p, torch.device("cpu"), group=g)
            sched = schedule(stage, n_microbatches=4, loss_fn=loss_fn)
            losses = []
            if r == 0:
                sched.step(x)
            elif r == p - 1:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            return losses, [q.grad.clone() for q in mod.parameters()]

        (la, ga), (lb, gb) = _both(run)
        _close(la, lb, f"{schedule.__name__} losses")
        _close(ga, gb, f"{schedule.__name__} grads")


def check_fsdp2_clip_grad_norm_and_full_state_dict_match_gloo(comm):
    """clip_grad_norm_ over FSDP2's DTensor gradients (a norm reduced across the group) then Adam, and
    get_state_dict / set_state_dict (full) of model and optimizer into a fresh sharded model: norms and
    parameters as on gloo and as one process on every rank's batches, the state restored bit for bit."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    _groups()
    batches = _batches(comm.rank, 2)
    full = StateDictOptions(full_state_dict=True)

    def run(backend):
        mesh = _mesh((comm.size,), ("dp",), backend)
        model = _mlp(5)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        norms = []
        for x, y in batches:
            ((model(x) - y) ** 2).mean().backward()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor())
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt, options=full)
        fresh = _mlp(6)
        fully_shard(fresh, mesh=mesh)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd, options=full)
        for a, b in zip(_params(model), _params(fresh)):
            assert torch.equal(a, b), "set_state_dict did not restore the parameters"
        return norms, _params(model)

    (na, pa), (nb, pb) = run("loom"), run("gloo")
    _close(na, nb, "fsdp2 clip_grad_norm_")
    _close(pa, pb, "fsdp2 params after clipping")
    # one process on every rank's batches (equal sizes: the mean of the ranks' mean losses)
    every = [_batches(r, 2) for r in range(comm.size)]
    ref = _mlp(5)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_norms = []
    for step in range(2):
        x = torch.cat([b[step][0] for b in every])
        y = torch.cat([b[step][1] for b in every])
        ((ref(x) - y) ** 2).mean().backward()
        ref_norms.append(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
    _close(na, ref_norms, "fsdp2 clip_grad_norm_ vs one process")
    _close(pa, _params(ref), "fsdp2 params after clipping vs one process")


def check_dcp_save_load_round_trip(comm):
    """torch.distributed.checkpoint saves an FSDP2 model's sharded state over loom and loads it into a fresh
    model, and ``dcp.async_save`` (torch asks the group for a CPU backend) a plain model's: every parameter comes
    back bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _groups()
    mesh = init_device_mesh("cpu", (comm.size,), mesh_dim_names=("dp",))
    sharded = (_mlp(3), _mlp(4))
    for m in sharded:
        fully_shard(m, mesh=mesh)
    for (model, fresh), save in ((sharded, dcp.save), ((_mlp(5), _mlp(6)), lambda *a, **k: dcp.async_save(
            *a, **k).result())):
        path = comm.bcast_object(tempfile.mkdtemp(prefix="loom-dcp-") if comm.rank == 0 else None)
        save(model.state_dict(), checkpoint_id=path)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state)
        for a, b in zip(_params(model), _params(fresh)):
            assert torch.equal(a, b)


def check_compression_per_group_within_bound_and_exact_stays_exact(comm):
    """A group under ``zdp=bf16``: an allreduce within the codec's bound (two bf16 roundings: each input's and
    the reduced shard's, 2^-8 relative each), half the bytes on the wire; under ``exact()`` bit-exact and not
    compressed; other groups untouched; DDP over the group trains within 1e-2 of the uncompressed run."""
    import loom.compress as lc
    from loom import torchdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _groups()
    p, r = comm.size, comm.rank
    torchdist.set_compression("zdp=bf16")
    try:
        g = dist.new_group(list(range(p)), group_desc="mesh_zdp")
        plain = dist.new_group(list(range(p)), group_desc="mesh_other")
    finally:
        torchdist.set_compression(None)
    gen = torch.Generator().manual_seed(11)
    every = [torch.randn(1 << 15, generator=gen, dtype=torch.float64) for _ in range(p)]  # 256 KiB each
    want = sum(every)
    lc.reset_stats()
    x = every[r].clone()
    dist.all_reduce(x, group=g)
    bound = (sum(e.abs() for e in every) + want.abs()) * 2.0 ** -8
    assert ((x - want).abs() <= bound).all() and (x != want).any(), "not compressed, or out of the bf16 bound"
    st = lc.stats()["torch.mesh_zdp"]
    assert st["wire"] <= 0.3 * st["raw"], st  # bf16 of fp64: a quarter of the bytes, plus metadata
    dyadic = [_rand((1 << 15,), torch.float64, gen) for _ in range(p)]
    for group in (g, plain):
        y = dyadic[r].clone()
        with torchdist.exact():
            dist.all_reduce(y, group=group)
        z = dyadic[r].clone()
        if group is plain:
            dist.all_reduce(z, group=group)
            assert torch.equal(z, sum(dyadic))
        assert torch.equal(y, sum(dyadic))
    assert lc.stats()["torch.mesh_zdp"]["calls"] == st["calls"], "an exact reduction was compressed"
    assert "torch.mesh_other" not in lc.stats()
    # Outside a backward pass no residual is kept: nothing says which call of the last step a call repeats, and
    # one tensor's residual added to another's reduction is a wrong answer (a big tensor, then a small one of the
    # same shape: the small one stays within its own bound), also for all_reduce_coalesced's new flat buffers.
    fb = g._feedback
    fb.reset()
    big, small = (torch.randn(1 << 14, generator=gen, dtype=torch.float64) * s for s in (100.0, 1e-3))
    for i, x in enumerate((big, small, big.clone(), small.clone())):
        y = x.clone()
        (dist.all_reduce if i < 2 else lambda t, group: dist.all_reduce_coalesced([t], group=group))(y, group=g)
        assert ((y - p * x).abs() <= 2 * p * x.abs().max() * 2.0 ** -8).all(), (i, (y - p * x).abs().max())
    assert len(fb) == 0, list(fb._res)
    batches = _batches(r, 3, n=8)

    def run(group):
        torch.manual_seed(4)
        model = DDP(nn.Sequential(nn.Linear(8, 1024), nn.Tanh(), nn.Linear(1024, 4)).double(), process_group=group)
        return _train(model, batches)

    calls = lc.stats()["torch.mesh_zdp"]["calls"]
    (la, pa), (lb, pb) = run(g), run(plain)
    assert lc.stats()["torch.mesh_zdp"]["calls"] > calls, "DDP's buckets were not compressed"
    assert len(fb) and all(k[0] == "allreduce" for k in fb._res), list(fb._res)  # inside backward: by position
    for a, b in zip(la, lb):
        assert abs(a - b) <= 1e-2 * abs(b), (la, lb)
    for a, b in zip(pa, pb):
        assert (a - b).abs().max() <= 1e-2, (a - b).abs().max()


def check_compressed_reduce_scatter_and_fsdp2_under_a_dp_policy(comm):
    """A group under ``fdp=int8``: ``reduce_scatter_tensor`` (SUM) and list ``reduce_scatter`` (AVG) within one
    int8 quantization of every other rank's block (``max|B| / 254`` per 64-element block, each rank's own block
    exact), 0.14x the raw bytes on the wire (int8 of fp64: 1/8 plus a scale per block); under ``exact()``
    bit-exact and not compressed. FSDP2 ``fully_shard`` over a DeviceMesh of that group trains within 1e-3 of
    the same run on an uncompressed group (each step's gradients within ``P - 1`` int8 quantizations, 3 SGD
    steps at lr 0.1; seen: 5e-5 relative in the losses, 1e-4 in the parameters), at 0.13x the raw bytes, one
    residual per reduce-scatter of a step (not one per step)."""
    from loom import torchdist

    _groups()
    p = comm.size
    torchdist.set_compression("fdp=int8")
    try:
        g = dist.new_group(list(range(p)), group_desc="mesh_fdp")
    finally:
        torchdist.set_compression(None)
    plain = dist.new_group(list(range(p)), group_desc="mesh_fplain")
    _reduce_scatters_within_int8(comm, g)
    _fsdp2_compressed_against_plain(comm, g, plain)
    _reentrant_blocks_keep_no_residual(g)


def _reduce_scatters_within_int8(comm, g) -> None:
    import loom.compress as lc
    from loom import torchdist

    p, r = comm.size, comm.rank
    int8 = lc.get_codec("int8")
    gen = torch.Generator().manual_seed(12)
    lc.reset_stats()
    for n, form in ((8192, "tensor"), (6000, "list")):  # >= 64 KiB in all: compressed
        every = [torch.randn(p * n, generator=gen, dtype=torch.float64) * (1 + i) for i in range(p)]
        blocks = [e.view(p, n)[r] for e in every]
        want = sum(blocks)
        out = torch.empty(n, dtype=torch.float64)
        if form == "tensor":
            dist.reduce_scatter_tensor(out, every[r], group=g)
        else:
            dist.reduce_scatter(out, list(every[r].view(p, n)), op=dist.ReduceOp.AVG, group=g)
            want = want / p
        bound = sum(int8.error_bound(b) for i, b in enumerate(blocks) if i != r) / (p if form == "list" else 1)
        err = (out - want).abs()
        assert (err <= bound + 1e-12).all() and (out != want).any(), f"{form}: not compressed, or out of bound"
    st = lc.stats()["torch.mesh_fdp"]
    assert st["calls"] == 2 and st["wire"] <= 0.14 * st["raw"], st
    dyadic = [_rand((p * 8192,), torch.float64, gen) for _ in range(p)]
    y = torch.empty(8192, dtype=torch.float64)
    with torchdist.exact():
        dist.reduce_scatter_tensor(y, dyadic[r], group=g)
    assert torch.equal(y, sum(d.view(p, -1)[r] for d in dyadic)), "a reduction under exact() was not exact"
    assert lc.stats()["torch.mesh_fdp"]["calls"] == 2, "a reduction under exact() was compressed"


def _fsdp2_compressed_against_plain(comm, g, plain) -> None:
    import loom.compress as lc
    from loom.torchdist.backend import LoomProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    batches = _batches(comm.rank, 3, n=8)

    def run(group, name):
        torch.manual_seed(5)
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(name,))
        model = nn.Sequential(nn.Linear(8, 1024), nn.Tanh(), nn.Linear(1024, 8), nn.Tanh(), nn.Linear(8, 1024),
                              nn.Tanh(), nn.Linear(1024, 4)).double()
        fully_shard(model[0], mesh=mesh)  # two groups of one shape (the residuals must not mix), and the root
        fully_shard(model[4], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _train(model, batches)

    assert isinstance(g, LoomProcessGroup), type(g)
    g._feedback.reset()  # the residuals of the calls before
    lc.reset_stats()
    (la, pa), (lb, pb) = run(g, "fdp"), run(plain, "fplain")
    st = lc.stats()
    assert "torch.mesh_fplain" not in st and st["torch.mesh_fdp"]["calls"] >= 9, st
    assert st["torch.mesh_fdp"]["wire"] < 0.2 * st["torch.mesh_fdp"]["raw"], st
    keys = [k for k in g._feedback._res if k[0] == "reduce_scatter"]
    assert len(keys) == 3, f"one residual per reduce-scatter of a step, got {keys}"
    for a, b in zip(la, lb):
        assert abs(a - b) <= 1e-3 * abs(b), (la, lb)
    assert la != lb, "the fdp run was not compressed"
    for a, b in zip(pa, pb):
        assert (a - b).abs().max() <= 1e-3, (a - b).abs().max()


def _reentrant_blocks_keep_no_residual(g) -> None:
    """Reentrant activation checkpointing runs each block's backward as its own graph task: places in a task
    repeat from block to block, so those reduce-scatters keep no residual (same-shape blocks would share one)."""
    import loom.compress as lc
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=True)
            return x

    mesh = DeviceMesh.from_group(g, "cpu", mesh_dim_names=("fdp",))
    model = Blocks().double()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    g._feedback.reset()
    calls = lc.stats()["torch.mesh_fdp"]["calls"]
    model(torch.randn(4, 128, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert lc.stats()["torch.mesh_fdp"]["calls"] >= calls + 3, "the checkpointed blocks were not compressed"
    assert len(g._feedback) == 0, f"residuals under reentrant checkpointing: {list(g._feedback._res)}"


def check_all_to_all_single_through_the_multipath_relay_matches_gloo(comm):
    """A group under ``zmp=testbed`` (4 ranks: the 2-node x 2-rail testbed, declared, no root needed; 2 ranks: one
    node, so MPI's alltoallv): uneven all_to_all_single with a hot pair, every dtype, contiguous or not, equals
    gloo's (fp64, int32) and the plain loom world group's (all); at 4 ranks the relay moved it (point-to-point
    legs, relayed bytes sent twice, no alltoallv), at 2 ranks MPI's alltoallv did."""
    from loom import torchdist
    from loom.comm import stats as comm_stats

    loom_g, gloo_g = _groups()
    p, r = comm.size, comm.rank
    for bad, why in (("zmp=nosuch", "nosuch"), ("zmp=testbed:min=3", "min_bytes=N"), ("zmp", "GROUP=TOPOLOGY")):
        try:
            torchdist.set_multipath(bad)
        except ValueError as exc:
            assert why in str(exc), exc
        else:
            raise AssertionError(f"set_multipath({bad!r}) did not raise")
    torchdist.set_multipath("zmp=testbed:min_bytes=1024")
    try:
        g = dist.new_group(list(range(p)), group_desc="mesh_zmp")
    finally:
        torchdist.set_multipath(None)
    shared = torch.Generator().manual_seed(41)  # the counts matrix, the same on every rank
    gen = torch.Generator().manual_seed(400 + r)
    relayed = 4 if p == 4 else 2  # the testbed's hot pair crosses nodes and rails: rank 0 -> rank 3
    for dtype in (torch.float64, torch.int32, torch.bool, torch.bfloat16, torch.float32):
        counts = torch.randint(0, 4, (p, p), generator=shared)
        counts[0, relayed - 1] += 1024  # 8 KiB of bool rows of 8, 64 KiB of fp64: above min_bytes
        if dtype == torch.bool:
            counts[p - 1] = 0  # a rank that sends nothing still joins
        send, recv = counts[r].tolist(), counts[:, r].tolist()
        x = _rand((sum(send), 8), dtype, gen)
        for layout in ("contiguous", "transposed"):
            def a2a(group):
                inp = x if layout == "contiguous" else x.t().contiguous().t()
                out = torch.zeros((sum(recv), 8), dtype=dtype)
                _wait(dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=group,
                                             async_op=layout == "transposed"))
                return out
            before = dict(comm_stats().get("torch.mesh_zmp", {}))
            got = a2a(g)
            after = comm_stats()["torch.mesh_zmp"]
            sent = after.get("send", 0) - before.get("send", 0)
            plain = after.get("alltoallv", 0) - before.get("alltoallv", 0)
            _same(got, a2a(loom_g), f"all_to_all_single multipath {dtype} {layout} vs the plain path")
            if dtype in (torch.float64, torch.int32) and layout == "contiguous":  # gloo: contiguous only
                _same(got, a2a(gloo_g), f"all_to_all_single multipath {dtype} {layout} vs gloo")
            payload = (counts.sum() - counts.diagonal().sum()).item() * 8 * x.element_size()
            total = comm.allreduce(torch.tensor([sent, plain], dtype=torch.int64), "sum").tolist()
            if p == 4:  # every off-node byte of the hot pair relayed: sent twice
                assert total[1] == 0 and total[0] > payload, (dtype, total, payload)
            else:
                assert total[0] == 0 and total[1] == payload, (dtype, total, payload)
    # an even split of an empty row width and of zero rows: nothing to move, nothing raised
    for shape in ((0, 8), (4 * p, 0)):
        out = torch.empty(shape, dtype=torch.float64)
        dist.all_to_all_single(out, torch.ones(shape, dtype=torch.float64), group=g)


def check_wait_timeout_raises_then_the_exchange_completes(comm):
    """A recv whose sender has not sent: wait(timeout) raises RuntimeError naming recv, the group and the
    timeout (a timedelta, then seconds), the recv stays posted; after the sender sends, wait() completes it."""

    _groups()
    p, r = comm.size, comm.rank
    if r == 0:
        buf = torch.zeros(5, dtype=torch.float64)
        work = dist.irecv(buf, src=p - 1, tag=3)
        for timeout in (datetime.timedelta(milliseconds=200), 0.1):
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                msg = str(exc)
                assert f"recv from rank {p - 1}" in msg and "'torch'" in msg and "timeout" in msg, msg
                assert f"{timeout.total_seconds() if hasattr(timeout, 'total_seconds') else timeout:g} s" in msg, msg
            else:
                raise AssertionError(f"wait(timeout={timeout!r}) on a recv never sent returned")
            assert not work.is_completed()
        try:
            work.wait(timeout=-1)
        except ValueError as exc:
            assert "timeout=-1" in str(exc), exc
        else:
            raise AssertionError("wait(timeout=-1) did not raise")
    dist.barrier()
    if r == p - 1:
        dist.send(torch.arange(5, dtype=torch.float64), 0, tag=3)
    if r == 0:
        assert work.wait(timeout=datetime.timedelta(seconds=600))
        assert torch.equal(buf, torch.arange(5, dtype=torch.float64))
        done = dist.all_reduce(torch.ones(1), async_op=True)
        assert done.wait(timeout=datetime.timedelta(0)) and done.wait(timeout=0.01)
    else:
        dist.all_reduce(torch.ones(1))
    dist.barrier()


def check_sparse_all_reduce_and_ddp_with_sparse_gradients_match_gloo(comm):
    """all_reduce of a sparse COO tensor (indices overlapping across ranks, some rows on one rank only) and DDP over
    an ``nn.Embedding(sparse=True)``, trained 4 steps, bit for bit as gloo (both sum the ranks in rank order)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(40 + comm.rank)
    idx = torch.tensor([[0, 2, 5 + comm.rank % 3], [1, 1, comm.rank % 8]])
    vals = torch.randn(3, 4, generator=gen, dtype=torch.float64)

    def reduce(g):
        t = torch.sparse_coo_tensor(idx, vals, (8, 8, 4))
        dist.all_reduce(t, group=g)
        return t.coalesce().to_dense()
    _same(*_both(reduce), "sparse all_reduce")
    data = [torch.randint(0, 50, (6, 3), generator=gen) for _ in range(4)]

    def train(g):
        torch.manual_seed(0)
        model = DDP(nn.EmbeddingBag(50, 8, mode="sum", sparse=True).double(), process_group=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data:
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return _params(model)
    _same(*_both(train), "DDP with sparse gradients")


def check_group_timeout_raises_like_gloo_and_the_job_goes_on(comm):
    """A group made with a 1 s timeout: a barrier, then a large asynchronous all_reduce (the progress thread's
    path), that only rank 0 joins raise on rank 0 after the timeout, naming the operation, the group and
    " Timed out " (the words torch's suite looks for), instead of blocking for ever; the group then refuses
    further work by name; a new group of the same ranks, and the default group, work."""
    _groups()
    for op in ("barrier", "all_reduce"):
        g = dist.new_group(list(range(comm.size)), timeout=datetime.timedelta(seconds=1))
        if comm.rank == 0:
            t0 = time.monotonic()
            try:
                if op == "barrier":
                    dist.barrier(group=g)
                else:
                    dist.all_reduce(torch.ones(1 << 16), group=g, async_op=True).wait()
            except RuntimeError as exc:
                msg = str(exc)
                assert " Timed out " in msg and op in msg and "torch." in msg, msg
            else:
                raise AssertionError(f"a {op} that no peer joined returned")
            assert time.monotonic() - t0 < 30  # gone at its 1 s timeout, not at the default 30 minutes
            try:
                dist.all_reduce(torch.ones(1), group=g)
            except RuntimeError as exc:
                assert "make a new" in str(exc), exc
            else:
                raise AssertionError("a group whose operation timed out took more work")
        dist.barrier()
        fresh = dist.new_group(list(range(comm.size)))
        y = torch.ones(2, dtype=torch.float64)
        dist.all_reduce(y, group=fresh)
        assert y.tolist() == [float(comm.size)] * 2


# ---------------------------------------------------------------------------------------------- errors
def check_rendezvous_failure_raises_on_every_rank(comm):
    """A rank that reaches no address of rank 0 fails the rendezvous on every rank (not only there, leaving the
    others to wait out the store's 30-minute timeout)."""
    from loom.torchdist import rendezvous

    if comm.size < 2:
        return
    saved = rendezvous._reachable

    def unreachable(candidates, port):
        if comm.rank == comm.size - 1:
            raise RuntimeError(f"no address of rank 0 ({', '.join(candidates)}) accepts a connection")
        return saved(candidates, port)

    rendezvous._reachable = unreachable
    try:
        next(rendezvous.mpi_rendezvous("env://", timeout=datetime.timedelta(seconds=20)))
    except RuntimeError as exc:
        assert f"rank {comm.size - 1}:" in str(exc) and "accepts a connection" in str(exc), str(exc)
    else:
        raise AssertionError("the rendezvous went on although one rank reached no address of rank 0")
    finally:
        rendezvous._reachable = saved


def check_unsupported_op_and_mismatch_raise_on_every_rank(comm):
    _groups()
    x = torch.ones(3, dtype=torch.int64)
    try:
        dist.all_reduce(x, op=dist.ReduceOp.BAND)
    except NotImplementedError as exc:
        assert "ReduceOp.BAND" in str(exc) and "loom" in str(exc), exc
    else:
        raise AssertionError("ReduceOp.BAND did not raise NotImplementedError")
    safety.configure(check=True)
    try:
        y = torch.ones(3 + comm.rank % 2, dtype=torch.float64)
        dist.all_reduce(y)
    except CollectiveMismatchError as exc:
        assert "disagree" in str(exc), exc
    else:
        raise AssertionError("a shape mismatch under LOOM_CHECK did not raise")
    finally:
        safety.configure(check=False)
    z = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(z)  # the group still works after the error
    assert torch.equal(z, torch.full((2,), float(comm.size), dtype=torch.float64))


def check_teardown(comm):
    """Last: destroy every group (torch's own shutdown path over loom)."""
    _groups()
    dist.destroy_process_group()
    _STATE.clear()


mpi_checks(globals())
