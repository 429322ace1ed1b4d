"""Sequence parallelism for long-context attention: DeepSpeed-Ulysses, the ring and FPDT, all autograd-exact.

Vocabulary: ``P`` is the size of the sequence-parallel communicator (the ``sp`` mesh axis), ``u`` the number
of chunks per rank, ``c`` the chunk length, so a global sequence of ``n`` tokens gives ``s = n / P = u * c``
tokens per rank. Activations are ``[batch, seq, heads, head_dim]`` ("sequence layout"; the layout of
``torch.nn.functional.scaled_dot_product_attention`` after ``transpose(1, 2)``).

Token layouts (:func:`shard_sequence` / :func:`gather_sequence`):

* Ulysses (``chunks=1``): rank ``r`` holds the contiguous range ``[r s, (r+1) s)``.
* FPDT (``chunks=u``): the sequence is cut into ``u P`` pieces of ``c`` tokens and rank ``r`` holds pieces
  ``r, r+P, r+2P, ...``; local chunk ``i`` is global piece ``i P + r``, so after the all-to-all of local chunk
  ``i`` every rank holds the *contiguous* global range ``[i P c, (i+1) P c)`` for its ``H / P`` heads. This is
  what lets causal attention of chunk ``i`` start before chunk ``i+1`` has been communicated (FPDT paper,
  Sec. 4.1). ``chunks=1`` is the Ulysses layout.

Plans:

* :func:`ulysses_attention`: one packed all-to-all (q, k, v concatenated along heads) from sequence- to
  head-sharding, local attention over the whole sequence for ``H / P`` heads, one all-to-all back. The
  backward mirrors it: one all-to-all of the output gradient, local attention backward, one packed
  all-to-all of (dq, dk, dv). 2 all-to-alls per layer forward, 2 backward.
* :func:`fpdt_attention`: per chunk, one packed all-to-all of (q_i, k_i, v_i); attention of q chunk ``i``
  against kv chunks ``j`` (``j <= i`` when causal) with an online-softmax merge of per-block outputs through
  their log-sum-exp, in fp32 (fp64 for fp64 inputs); one all-to-all of the output chunk back. Head-layout
  q/k/v/out chunks and the log-sum-exp go to the chunk store (host memory with ``offload=True``) and come back
  one chunk ahead of use. Backward is a second custom pipeline, kv chunk outer and q chunk inner (as in
  FlashAttention-2): per chunk one all-to-all of the output gradient; per kv chunk ``j`` the exact block
  gradients from the saved log-sum-exp, then one packed all-to-all of (dq_j, dk_j, dv_j) back (causal: dq_j
  is complete once kv chunk ``j`` is done; non-causal: dq chunks go back at the end). 2u all-to-alls forward
  and 2u backward per layer, each 1/u the size of Ulysses'.

GQA/MQA: ``kv_heads`` must divide ``heads``; when ``kv_heads`` is not a multiple of ``P`` (it must then
divide ``P``) each kv head is replicated ``P / kv_heads`` times before the all-to-all, and autograd sums the
replicas' gradients.

Kernel (:mod:`loom.parallel.blocks`): an SDPA kernel that returns the log-sum-exp (on CPU the flash kernel;
on CUDA FlashAttention-2 for fp16/bf16, memory-efficient attention for fp32 and packed-document masks), or
with ``LOOM_ATTN_KERNEL=torch`` and wherever none applies, a tiled pure-torch kernel whose working set is a
few ``TILE x TILE`` score tiles, not ``(P c)^2``. No flash-attn dependency.

Modules, by concern: :mod:`.layout` (sizes, head plans, token layouts), :mod:`.alltoall` (the sequence <-> head
all-to-all and its counter), :mod:`.ulysses`, :mod:`.ring` (Ulysses x ring and the ring's K/V passes),
:mod:`.fpdt_pipeline` (FPDT's chunk pipeline), :mod:`.fpdt_ring` (FPDT x ring) and :mod:`.fpdt`
(``fpdt_attention``); every public name is importable from this package, as before the split.
"""

from __future__ import annotations

from ..blocks import attention_kernel
from .alltoall import alltoall_stats, heads_to_seq, reset_alltoall_stats, seq_to_heads
from .fpdt import fpdt_attention
from .fpdt_pipeline import FPDTPipeline
from .fpdt_ring import FPDTRingPipeline
from .layout import HeadPlan, check_sizes, gather_sequence, local_positions, ring_positions, shard_sequence
from .ring import ring_attention, ring_groups
from .ulysses import ulysses_attention

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "ring_groups",
    "ring_positions",
    "fpdt_attention",
    "shard_sequence",
    "gather_sequence",
    "local_positions",
    "seq_to_heads",
    "heads_to_seq",
    "check_sizes",
    "HeadPlan",
    "alltoall_stats",
    "reset_alltoall_stats",
    "attention_kernel",
    "FPDTPipeline",
    "FPDTRingPipeline",
]
