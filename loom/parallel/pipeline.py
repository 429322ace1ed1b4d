"""Pipeline parallelism over a captured :class:`~loom.parallel.partition.Graph`: stages, schedules, p2p.

A stage rank runs its contiguous slice of the graph on one micro-batch at a time. Between neighbouring
stages travels the boundary's *live set* (every value a later stage still reads, so skip connections that
cross several stages are forwarded hop by hop); backward sends the gradient of each live tensor that
requires grad the other way.

Communication plan of one training step on stage ``s`` of ``P`` (pp communicator, dup'd for isolation):

* forward of micro-batch ``m``: blocking ``recv`` of each live tensor from ``s-1`` (tag ``ACT``) into a fresh
  buffer that becomes an autograd leaf; compute; ``isend`` of each live tensor to ``s+1``;
* backward of ``m``: blocking ``recv`` of the gradients from ``s+1`` (tag ``GRAD``), ``autograd.backward`` of
  the stage outputs with them (the last stage backpropagates ``loss_m / M`` instead), ``isend`` of the
  received leaves' gradients to ``s-1``;
* all sends are non-blocking and waited at the end of the step, so the only blocking calls are receives and
  the 1F1B steady state (send forward while the neighbour sends backward) cannot deadlock;
* shapes: the first time a micro-batch input shape is seen, the sender first sends a pickled description of
  the live set (shapes, dtypes, requires_grad, and non-tensor values such as ``x.size(0)``; tag ``META``);
  both sides cache it by that shape, so steady-state steps send tensors only.

Schedules (:func:`schedule`): ``gpipe`` (all forwards, then all backwards) and ``1f1b`` (``P-s-1`` warm-up
forwards, then one-forward-one-backward, then the remaining backwards; activation memory bounded by ``P``
micro-batches instead of ``M``); :func:`interleaved_schedule` (``v`` virtual stages per rank, stage ``j`` on
rank ``j % P``: the stage graph becomes a ring, the bubble shrinks by ``v`` for ``v`` times the messages).
Tags are ``4 * boundary + kind``, so the boundaries of different virtual stages never mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree

from ..comm import Communicator, Request
from .partition import Graph, resolve, run_node

__all__ = ["SCHEDULES", "schedule", "interleaved_schedule", "Stage"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

ACT, GRAD, META = 1, 2, 3  # tag = 4 * boundary + kind: one tag space per stage boundary (virtual stages)


def schedule(kind: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The ordered ``("F"|"B", micro_batch)`` actions of ``stage`` under ``kind``.

    Raises:
        ValueError: unknown schedule.
    """
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind == "1f1b":
        warm = min(stages - stage - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        return ops
    raise ValueError(f"schedule={kind!r} is not one of {', '.join(SCHEDULES)}")


def interleaved_schedule(ranks: int, chunks: int, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): rank ``r`` holds stages ``r, r+P, ..., r+(v-1)P``.

    Returns, per rank, the ordered ``("F"|"B", chunk, micro_batch)`` actions (stage = ``chunk * P + r``).

    The orders come from simulating the pipeline in unit time steps: each rank walks its forwards in
    Megatron's order (micro-batches in groups of ``P``, chunk by chunk) and its backwards in the mirrored order,
    runs a backward once it has ``2 (P - r - 1) + (v - 1) P + 1`` forwards in flight (Megatron's warm-up)
    or has no forward ready, and an action is ready only when what it receives was produced at an earlier
    step. Every receive therefore matches a send issued earlier in the global timeline, so with
    non-blocking sends and blocking receives the schedule cannot deadlock, for any ``M``.

    Raises:
        ValueError: non-positive sizes.
    """
    p, v, m = ranks, chunks, micro_batches
    if min(p, v, m) < 1:
        raise ValueError(f"interleaved schedule needs ranks, chunks, micro_batches >= 1, got {p}, {v}, {m}")
    last = p * v - 1
    fwd: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    for r in range(p):
        for g in range(0, m, p):
            for k in range(v):
                fwd[r] += [(k * p + r, i) for i in range(g, min(g + p, m))]
    bwd = [[(s, i) for s, i in ((k * p + r, i) for g in range(0, m, p) for k in reversed(range(v))
                                for i in range(g, min(g + p, m)))] for r in range(p)]
    limit = [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    fi, bi = [0] * p, [0] * p
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    t = 0
    while any(bi[r] < len(bwd[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            f_ok = fi[r] < len(fwd[r]) and (fwd[r][fi[r]][0] == 0 or
                                             f_done.get((fwd[r][fi[r]][0] - 1, fwd[r][fi[r]][1]), t) < t)
            b_ok = False
            if bi[r] < len(bwd[r]):
                s_, i = bwd[r][bi[r]]
                b_ok = f_done.get((s_, i), t) < t and (s_ == last or b_done.get((s_ + 1, i), t) < t)
            if b_ok and (fi[r] - bi[r] >= limit[r] or not f_ok):
                s_, i = bwd[r][bi[r]]
                b_done[(s_, i)] = t
                out[r].append(("B", s_ // p, i))
                bi[r] += 1
            elif f_ok:
                s_, i = fwd[r][fi[r]]
                f_done[(s_, i)] = t
                out[r].append(("F", s_ // p, i))
                fi[r] += 1
            else:
                continue
            progressed = True
        if not progressed:  # nothing could run: nothing will ever change
            raise RuntimeError(f"interleaved schedule stalled at step {t} (P={p}, v={v}, M={m}); please report")
        t += 1
    return out


@dataclass(slots=True)
class _Slot:
    """What one micro-batch leaves on a stage between its forward and its backward."""

    leaves: list[torch.Tensor | None]  # received live tensors (autograd leaves), None for non-tensors
    outs: list[torch.Tensor]  # sent live tensors that require grad (backward roots)
    loss: torch.Tensor | None  # last stage only


class Stage:
    """Stage ``index`` of ``graph`` split as ``counts``, talking to its neighbours on ``comm``.

    Args:
        graph: the captured model.
        counts: units per stage (from :func:`~loom.parallel.partition.split_units`).
        comm: the pipeline communicator (rank = stage index); ``None`` when there is one stage.
        codec: optional ``loom.compress`` codec for activations and gradients (non-blocking, any schedule).
        index: the (virtual) stage index; default ``comm.rank``. Stage ``j`` runs on rank ``j % comm.size``.
    """

    def __init__(self, graph: Graph, counts: Sequence[int], comm: Communicator | None, *, codec: Any = None,
                 index: int | None = None):
        self.graph = graph
        self.counts = list(counts)
        self.stages = len(counts)
        self.index = index if index is not None else (comm.rank if comm is not None else 0)
        p = comm.size if comm is not None else 1
        self.prev, self.next = (self.index - 1) % p, (self.index + 1) % p  # ranks (a ring with virtual stages)
        self.comm = comm
        self.codec = codec
        if comm is not None:  # the largest tag: the last boundary's META
            comm.require_tags(4 * (self.stages - 1) + META, f"a pipeline of {self.stages} (virtual) stages",
                              "use fewer stages or virtual stages")
        self.nodes = graph.stage_nodes(counts, self.index)
        live = graph.live_sets(counts)
        self.live_in: list[str] = live[self.index - 1] if self.index > 0 else []
        self.live_out: list[str] = live[self.index] if self.index < self.stages - 1 else []
        self.first = self.index == 0
        self.last = self.index == self.stages - 1
        self._meta_in: dict[Any, list] = {}
        self._meta_sent: set[Any] = set()
        self._pending: list[Request] = []
        # Receive buffers live where the stage computes (CUDA tensors go through loom.comm's CUDA-aware or
        # host-staged path).
        own = self.tensors()
        self.device = own[0].device if own else torch.device("cpu")

    # ------------------------------------------------------------------ parameters
    def tensors(self) -> list[torch.Tensor]:
        """Every model tensor (parameters and buffers) this stage reads, de-duplicated, in node order."""
        seen: dict[int, torch.Tensor] = {}
        for n in self.nodes:
            for p in n.params:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors of this stage."""
        return [p for p in self.tensors() if p.requires_grad]

    # ------------------------------------------------------------------ p2p
    def _tag(self, side: int, kind: int) -> int:
        """Tag of the boundary before (``side=-1``) or after (``0``) this stage."""
        return 4 * (self.index + side) + kind

    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        t = t.detach().contiguous()
        if self.codec is not None:
            from ..compress import isend as cisend  # lazy: compression is optional

            self._pending.extend(cisend(t, dest, self.comm, self.codec, tag=tag))
        else:
            self._pending.append(self.comm.isend(t, dest, tag))

    def _recv(self, shape, dtype, source: int, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if self.codec is not None:
            from ..compress import recv as crecv

            return crecv(out, source, self.comm, self.codec, tag=tag)
        return self.comm.recv(out, source, tag)

    def _recv_live(self, key: Any, grad: bool) -> tuple[list[Any], list[Any]]:
        """The live values from ``s-1`` and their flattened leaves (tuples of tensors are flattened)."""
        meta = self._meta_in.get(key)
        if meta is None:
            spec, leaf_meta = self.comm.recv_object(self.prev, self._tag(-1, META))
            meta = self._meta_in[key] = (_pytree.treespec_loads(spec), leaf_meta)
        spec, leaf_meta = meta
        flat: list[Any] = []
        for m in leaf_meta:
            if m[0] == "t":
                t = self._recv(m[1], m[2], self.prev, self._tag(-1, ACT))
                if grad and m[3]:
                    t.requires_grad_(True)
                flat.append(t)
            else:
                flat.append(m[1])
        return _pytree.tree_unflatten(flat, spec), flat

    def _send_live(self, key: Any, vals: list[Any]) -> list[Any]:
        """Send the live values to ``s+1``; returns their flattened leaves."""
        flat, spec = _pytree.tree_flatten(vals)
        if key not in self._meta_sent:
            # Non-tensor leaves (x.size(0), dtypes...) depend only on the input shape, which keys the cache.
            leaf_meta = [("t", tuple(v.shape), v.dtype, bool(v.requires_grad)) if isinstance(v, torch.Tensor)
                         else ("v", v) for v in flat]
            self.comm.send_object((_pytree.treespec_dumps(spec), leaf_meta), self.next, self._tag(0, META))
            self._meta_sent.add(key)
        for v in flat:
            if isinstance(v, torch.Tensor):
                self._send(v, self.next, self._tag(0, ACT))
        return flat

    def wait(self) -> None:
        """Complete every outstanding send of this step."""
        for r in self._pending:
            r.wait()
        self._pending.clear()

    # ------------------------------------------------------------------ compute
    def _run(self, inputs: Sequence[Any], received: list[Any], training: bool) -> dict[str, Any]:
        env: dict[str, Any] = dict(zip(self.graph.inputs, inputs))
        env.update(zip(self.live_in, received))
        for n in self.nodes:
            env[n.name] = run_node(n, env, training)
        return env

    def forward(self, key: Any, inputs: Sequence[Any], target: Any, loss_fn: Callable | None,
                grad: bool = True) -> tuple[_Slot, Any]:
        """Run micro-batch ``inputs`` through this stage; returns its backward slot and (last stage) output."""
        received, flat_in = self._recv_live((key, grad), grad) if not self.first else ([], [])
        env = self._run(inputs, received, grad)
        leaves = [r if isinstance(r, torch.Tensor) and r.requires_grad else None for r in flat_in]
        if not self.last:
            flat_out = self._send_live((key, grad), [env[name] for name in self.live_out])
            outs = [v for v in flat_out if isinstance(v, torch.Tensor) and v.requires_grad]
            return _Slot(leaves, outs, None), None
        out = resolve(self.graph.output, env)
        loss = loss_fn(out, target) if loss_fn is not None else None
        return _Slot(leaves, [], loss), out

    def backward(self, slot: _Slot, scale: float) -> None:
        """Backward of one micro-batch: gradients in from ``s+1`` (or ``loss * scale``), out to ``s-1``."""
        if self.last:
            if slot.loss is None:
                raise ValueError("train_step needs a loss_fn returning a scalar tensor")
            if slot.loss.requires_grad:
                (slot.loss * scale).backward()
        else:
            grads = [self._recv(o.shape, o.dtype, self.next, self._tag(0, GRAD)) for o in slot.outs]
            if slot.outs:
                torch.autograd.backward(slot.outs, grads)
        if not self.first:
            for leaf in slot.leaves:
                if leaf is not None:
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    self._send(g, self.prev, self._tag(-1, GRAD))
