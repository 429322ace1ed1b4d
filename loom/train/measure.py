"""What a ``loom train`` step measures: communication seconds and bytes per mesh axis, offload bytes, peak memory."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from .. import stats as _stats
from ..comm import Communicator, stats
from ..compress import stats as compress_stats
from ..parallel.data import dp_stats
from ..parallel.offload import transfer_stats
from ..parallel.zero import zero_stats
from ..stats import Axis, flat_axis

__all__ = ["COMM_TIME", "TimedComm", "StepMeter", "peak_memory"]

# Seconds spent inside sequence-parallel calls (forward and backward), read by the step-time breakdown.
COMM_TIME = _stats.AxisCounter("time", "comm")


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _wire_bytes() -> dict[str, int]:
    return {name: sum(ops.values()) for name, ops in stats().items()}


def _offload_bytes() -> int:
    """Bytes moved between device and host memory by FPDT's chunk stores so far (loom.parallel.offload)."""
    t = transfer_stats()
    return int(t.get("to_host", 0) + t.get("to_device", 0))


def _saved_bytes() -> dict[str, int]:
    """Per communicator name: uncompressed minus on-the-wire bytes of loom.compress collectives so far."""
    return {k: v.get("raw", 0) - v.get("wire", 0) for k, v in compress_stats().items()}


class TimedComm:
    """A communicator proxy for the attention code: times its calls and applies the policy's ``sp`` codec.

    The attention code (``loom.parallel.sequence``) only calls ``size``/``rank``/``alltoall`` (and the loss an
    ``allreduce`` of a token count). Seconds spent in calls are added to ``COMM_TIME[key]`` for the step-time
    breakdown; with a codec, ``alltoall`` becomes ``loom.compress.alltoallv`` with equal counts (each block
    for another rank encoded, the own block kept exact), so the bytes saved show up in
    ``loom.compress.stats()[key]``.
    """

    _TIMED = frozenset({"alltoall", "alltoallv", "allreduce", "allgather", "send", "recv", "sendrecv",
                        "reduce_scatter", "bcast", "ialltoallv", "iallreduce", "iallgather"})

    def __init__(self, comm: Communicator, key: str, codec: Any = None, min_bytes: int | None = None):
        self._comm, self._key, self._codec = comm, key, codec
        self._min = {} if min_bytes is None else {"min_bytes": min_bytes}
        COMM_TIME.setdefault(key, 0.0)

    def _compressed_alltoall(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        from ..compress import alltoallv

        p = self._comm.size
        counts = [tensor.shape[0] // p] * p
        res, _ = alltoallv(tensor, counts, self._comm, self._codec, recv_counts=counts, **self._min)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def __getattr__(self, name: str) -> Any:
        if name == "alltoall" and self._codec is not None:
            attr = self._compressed_alltoall
        else:
            attr = getattr(self._comm, name)
        if name not in self._TIMED:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                COMM_TIME[self._key] += time.perf_counter() - t0

        return timed


def _host_floats(*values: torch.Tensor | float) -> list[float]:
    """Python floats of scalar tensors (on any device) and floats, with one device-to-host copy in all."""
    ts = [v for v in values if isinstance(v, torch.Tensor)]
    if not ts:
        return [float(v) for v in values]
    got = iter(torch.stack([t.detach().reshape(()).to(device=ts[0].device, dtype=torch.float64) for t in ts])
               .tolist())
    return [next(got) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _tpsp_seconds() -> float:
    return COMM_TIME.get("sp", 0.0) + COMM_TIME.get("tp", 0.0)


class StepMeter:
    """One step's measurements: started before the step, stopped right after it (before its loss and peak
    memory are reduced over the ranks, which are not the step's traffic)."""

    _AXES = (Axis.DP, flat_axis(Axis.DP, Axis.EP), flat_axis(Axis.DP, Axis.SP), Axis.EP, Axis.PP, Axis.SP, Axis.TP)

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.wire0, self.saved0, self.off0 = _wire_bytes(), _saved_bytes(), _offload_bytes()
        self.tpsp0 = _tpsp_seconds()
        self.zero0, self.dp0 = zero_stats(), dp_stats()

    def stop(self, sync_s: float) -> dict[str, Any]:
        """The record's measured fields: ``step_time``, ``time`` (compute; exposed communication: the gradient
        sync's ``sync_s`` seconds, ZeRO's and the dp reducers' waits, sp and tp calls; overlapped: dp reductions
        and ZeRO reduce-scatters in flight while backward ran, hidden inside compute and not part of the sum),
        ``bytes`` per mesh axis (on the wire and uncompressed), ``offload_bytes`` and ``compress_ratio``."""
        step_s = time.perf_counter() - self.t0
        wire, saved, off = _wire_bytes(), _saved_bytes(), _offload_bytes()
        zero, dp = zero_stats(), dp_stats()
        zero_s = zero["exposed_comm_s"] - self.zero0["exposed_comm_s"]  # blocked on gathers, reduce-scatters
        dp_s = dp["exposed_comm_s"] - self.dp0["exposed_comm_s"]  # this reducer's and HybridParallel's
        overlapped_s = (dp["overlapped_comm_s"] - self.dp0["overlapped_comm_s"]
                        + zero["overlapped_comm_s"] - self.zero0["overlapped_comm_s"])
        comm_s = sync_s + zero_s + dp_s + _tpsp_seconds() - self.tpsp0
        by_axis: dict[str, dict[str, int]] = {}
        for axis in self._AXES:
            sent = wire.get(axis, 0) - self.wire0.get(axis, 0)
            if sent:
                by_axis[axis] = {"wire": sent, "raw": sent + saved.get(axis, 0) - self.saved0.get(axis, 0)}
        raw_all = sum(v["raw"] for v in by_axis.values())
        wire_all = sum(v["wire"] for v in by_axis.values())
        return {"step_time": step_s,
                "time": {"compute": max(0.0, step_s - comm_s), "comm": comm_s, "offload": 0.0, "zero": zero_s,
                         "dp": dp_s, "overlapped": overlapped_s},
                "bytes": by_axis, "offload_bytes": off - self.off0,
                "compress_ratio": (raw_all / wire_all) if wire_all else 1.0}
