"""``loom bench``: OMB-style communication benchmarks and application benchmarks.

Every benchmark is a module with ``main(argv) -> int`` registered in :data:`BENCHMARKS`; the shared timing
loop, size sweep, table printer and JSON writer live in :mod:`loom.comm.measure` (as ``loom.bench.omb``).
"""

from __future__ import annotations

__all__ = ["BENCHMARKS"]

# name -> (module, attribute, description)
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "latency": ("loom.bench.comm", "latency", "point-to-point ping-pong latency (osu_latency)"),
    "bw": ("loom.bench.comm", "bw", "unidirectional bandwidth, windowed (osu_bw)"),
    "bibw": ("loom.bench.comm", "bibw", "bidirectional bandwidth (osu_bibw)"),
    "allreduce": ("loom.bench.comm", "allreduce", "allreduce latency (osu_allreduce)"),
    "allgather": ("loom.bench.comm", "allgather", "allgather latency (osu_allgather)"),
    "alltoall": ("loom.bench.comm", "alltoall", "alltoall latency (osu_alltoall)"),
    "alltoallv": ("loom.bench.comm", "alltoallv", "alltoallv latency (osu_alltoallv)"),
    "compress": ("loom.compress.benchmark", "allreduce_main", "compressed vs uncompressed allreduce (--codec NAME)"),
    "multipath": ("loom.multipath.bench", "alltoallv_skew", "skewed alltoallv: multi-path vs direct (--skew)"),
    "seqlen": ("loom.bench.seqlen", "main", "longest trainable sequence: Ulysses vs FPDT at a memory budget"),
    "memory": ("loom.bench.memory", "main", "loom train's dry-run memory model vs the measured peak per rank"),
    "hybrid": ("loom.bench.hybrid", "main", "step time: data parallel vs pipeline vs hybrid"),
    "parallel": ("loom.bench.parallel", "main", "Llama training step: dp vs tp vs pp and their mixes"),
    "compress-train": ("loom.bench.compress_train", "main", "data-parallel training with compression policies"),
    "moe": ("loom.bench.moe", "main", "MoE layer step time: direct vs multi-path dispatch"),
    "zero": ("loom.bench.zero", "main", "sharded data parallel (ZeRO 0-3): capacity at a budget, vs FSDP2 and DDP"),
    "dask": ("loom.bench.dask", "main", "Dask comm latency/bandwidth and applications: mpi:// vs tcp://"),
    "launchers": ("loom.bench.launchers", "main", "the \"loom\" torch backend under mpiexec, torchrun and mp.spawn: "
                  "1 B and large allreduce against raw mpi4py in the same world"),
    "torch": ("loom.bench.torchdist", "main", "the \"loom\" torch.distributed backend vs gloo: latency, bandwidth, "
              "DDP and FSDP2 steps"),
}
