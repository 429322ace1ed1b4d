"""``CompressionPolicy``: which codec each mesh axis uses, and the data-parallel gradient hook.

The split follows the reference study of compression-assisted collectives for LLM training (GPT-NeoX-20B,
3D parallelism + ZeRO): compressing *every* collective with the same lossy codec ("naive") bought +22.5 %
TFLOPS but hurt the loss; compressing the data-parallel gradient allreduce aggressively (gradients are
low-rank and noisy, and error feedback repairs what is dropped) while sending pipeline/tensor/sequence traffic
(activations, parameters) mildly or losslessly ("hybrid") kept the baseline loss at +17.3 % TFLOPS.

Presets (``CompressionPolicy.preset(name)``). ``naive`` is the peers' approach: one lossy codec inside every
collective, without error feedback (MVAPICH2-GDR compresses with ZFP; 8 bits/value is its 4x setting).
``hybrid`` is the reference's split: aggressive int4 (6.4x) with error feedback on dp, 2x bf16 on activations
(pp, sp, tp, ep). On tp the codec's error feeds forward through every layer unrepaired, so only a mild,
error-bounded codec belongs there (bf16: relative error at most 2^-8 per element per encode); ``zstd`` is
the lossless choice (``CompressionPolicy.preset("hybrid", tp="zstd")``).

==========  =========================  =======  =======  =======  =======  ===============
preset      dp                         pp       sp       tp       ep       error feedback
==========  =========================  =======  =======  =======  =======  ===============
``none``    --                         --       --       --       --       --
``naive``   zfp:rate=8                 zfp:r=8  zfp:r=8  zfp:r=8  zfp:r=8  off
``hybrid``  int4                       bf16     bf16     bf16     bf16     on (dp)
==========  =========================  =======  =======  =======  =======  ===============
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from ..comm import AXES, Communicator
from .codecs import Codec, get_codec
from .collectives import DEFAULT_MIN_BYTES, allreduce
from .feedback import ErrorFeedback

__all__ = ["CompressionPolicy", "DPHook", "dp_hook", "PRESETS"]

CodecSpec = "str | Codec | None"

PRESETS: dict[str, dict[str, Any]] = {
    "none": dict(dp=None, pp=None, sp=None, tp=None, ep=None, error_feedback=False),
    "naive": dict(dp="zfp:rate=8", pp="zfp:rate=8", sp="zfp:rate=8", tp="zfp:rate=8", ep="zfp:rate=8",
                  error_feedback=False),
    "hybrid": dict(dp="int4", pp="bf16", sp="bf16", tp="bf16", ep="bf16", error_feedback=True),
}


@dataclass(kw_only=True, slots=True)
class CompressionPolicy:
    """A codec per mesh axis (``None``: uncompressed), applied by loom's collectives on that axis.

    Codecs are given as names (``"int8"``, ``"powersgd:rank=4"``) or instances; :meth:`codec_for` returns one
    instance per axis for the policy's lifetime, so stateful codecs (PowerSGD's warm start) keep their state.
    """

    dp: CodecSpec = None
    """Data-parallel gradient allreduce (aggressive compression is safe here with error feedback)."""
    pp: CodecSpec = None
    """Pipeline activations and gradients (point-to-point)."""
    sp: CodecSpec = None
    """Sequence-parallel all-to-alls (Ulysses / FPDT activations)."""
    tp: CodecSpec = None
    """Tensor-parallel collectives (activations; errors here feed forward unrepaired)."""
    ep: CodecSpec = None
    """Expert-parallel (MoE) dispatch/combine all-to-alls."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """Messages smaller than this go uncompressed (encode cost beats the bytes saved)."""
    error_feedback: bool = True
    """Keep per-bucket residuals for the dp gradient sync (see :mod:`loom.compress.feedback`)."""
    _codecs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes < 0:
            raise ValueError(f"min_bytes={self.min_bytes!r} must be a non-negative integer (bytes)")
        for axis in AXES:
            spec = getattr(self, axis)
            if spec is None or isinstance(spec, Codec):
                continue
            if not isinstance(spec, str):
                raise TypeError(f"CompressionPolicy.{axis}={spec!r}: give a codec name, a Codec, or None")
            get_codec(spec)  # validates the name and options now, not at the first step

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "CompressionPolicy":
        """``none``, ``naive`` or ``hybrid`` (see the module table), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown compression preset {name!r}; valid: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def codec_for(self, axis: str) -> Codec | None:
        """The codec instance for mesh axis ``axis`` (``None`` when the axis is uncompressed)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(AXES)}")
        spec = getattr(self, axis)
        if spec is None:
            return None
        codec = self._codecs.get(axis)
        if codec is None:
            codec = self._codecs[axis] = get_codec(spec)
        return codec

    def state_dict(self) -> dict[str, Any]:
        """The state of every stateful codec made so far, by axis (for checkpoints)."""
        return {axis: st for axis, codec in self._codecs.items() if (st := codec.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for axis, st in state.items():
            codec = self.codec_for(axis)
            if codec is None:
                raise ValueError(f"compression state for axis {axis!r}, which this policy leaves uncompressed")
            codec.load_state_dict(st)

    def describe(self) -> dict[str, str]:
        """``{axis: codec}`` as text, for logs and benchmark tables."""
        out = {a: ("-" if getattr(self, a) is None else str(getattr(self, a))) for a in AXES}
        out["error_feedback"] = str(self.error_feedback)
        return out

    def replace(self, **changes: Any) -> "CompressionPolicy":
        """A copy with some fields changed (fresh codec instances)."""
        return dataclasses.replace(self, **changes)


class DPHook:
    """Data-parallel gradient sync: ``hook(flat_bucket, comm, bucket_index) -> mean over comm``.

    Each call is one :func:`loom.compress.allreduce` of the bucket (plan in its docstring) divided by
    ``comm.size``; the error-feedback residual is kept per ``bucket_index``. With PowerSGD, set
    ``hook.layouts[bucket_index] = [param shapes in bucket order]`` so each layer is compressed as its own
    matrix (the paper's layer-wise scheme); without it the bucket is one near-square matrix.

    Attributes:
        codec: the codec (``None``: plain ``comm.allreduce(op="avg")``).
        error_feedback: the residual store, or ``None``.
        min_bytes: buckets smaller than this are reduced uncompressed.
        layouts: optional per-bucket parameter shapes (PowerSGD only).
    """

    def __init__(self, codec: Codec | None, *, error_feedback: bool, min_bytes: int):
        self.codec = codec
        self.error_feedback = ErrorFeedback() if (error_feedback and codec is not None) else None
        self.min_bytes = min_bytes
        self.layouts: dict[Hashable, Sequence[Sequence[int]]] = {}

    def __call__(self, flat_bucket: torch.Tensor, comm: Communicator, bucket_index: int) -> torch.Tensor:
        # codec None: the plain comm.allreduce, still counted in loom.compress.stats() (raw == wire)
        out = allreduce(flat_bucket, comm, self.codec, error_feedback=self.error_feedback, key=bucket_index,
                        min_bytes=self.min_bytes, shapes=self.layouts.get(bucket_index))
        return out.div_(comm.size)

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals and the codec's state (PowerSGD's warm start): what a checkpoint keeps."""
        return {"error_feedback": None if self.error_feedback is None else self.error_feedback.state_dict(),
                "codec": None if self.codec is None else self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.error_feedback is not None and state.get("error_feedback") is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        if self.codec is not None and state.get("codec"):
            self.codec.load_state_dict(state["codec"])

    def __repr__(self) -> str:
        return f"DPHook(codec={self.codec!r}, error_feedback={self.error_feedback is not None})"


def dp_hook(policy_or_codec: "CompressionPolicy | str | Codec | None", *, error_feedback: bool = True) -> DPHook:
    """The gradient-sync hook for data parallelism: ``hook(flat_bucket, comm, bucket_index) -> mean``.

    Args:
        policy_or_codec: a :class:`CompressionPolicy` (its ``dp`` codec, ``min_bytes`` and
            ``error_feedback`` are used), a codec name or instance, or ``None`` for uncompressed.
        error_feedback: keep a residual per bucket (ANDed with the policy's own setting).
    """
    if isinstance(policy_or_codec, CompressionPolicy):
        pol = policy_or_codec
        return DPHook(pol.codec_for("dp"), error_feedback=error_feedback and pol.error_feedback,
                      min_bytes=pol.min_bytes)
    codec = None if policy_or_codec is None else get_codec(policy_or_codec)
    return DPHook(codec, error_feedback=error_feedback, min_bytes=DEFAULT_MIN_BYTES)
