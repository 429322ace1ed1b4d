"""Codecs: turn a tensor into a byte packet and back, lossily or not.

Every codec maps ``encode(tensor) -> Packet`` and ``decode(packet) -> tensor``. A :class:`Packet` is one
contiguous ``uint8`` tensor (what travels on the wire) plus the shape and dtype it decodes to; the receiver of
a compressed collective always knows the shape and dtype already (same-shaped shards, ``out`` buffers,
agreed counts), so only the bytes travel and :meth:`Codec.from_wire` rebuilds the packet.

Codecs and their error bounds (per element, on finite inputs; ``x`` the input, ``B`` a block of ``block``
consecutive elements of the flattened tensor):

=============  ======================================================  ===================================
name           encoding                                                bound on ``|decode(encode(x)) - x|``
=============  ======================================================  ===================================
``none``       raw bytes                                               0 (lossless)
``zstd``       raw bytes through Zstandard (level 1)                   0 (lossless)
``bf16``       round to bfloat16                                       ``2**-8 * |x|``
``fp16``       round to float16 (values beyond +-65504 saturate)       ``2**-11 * |x| + 2**-25``
``int8``       blockwise absmax: ``q = round(x * 127 / max|B|)``       ``max|B| / 254`` (+ fp32 rounding)
``int4``       blockwise absmax, two 4-bit codes per byte, ``[-7, 7]``  ``max|B| / 14``
``topk``       the ``ceil(fraction * n)`` largest magnitudes + int32   ``|x|`` for dropped elements, 0
               indices                                                 for kept ones
``powersgd``   rank-``r`` factors ``P Q^T`` of the tensor viewed as a  exact when the matrix has rank
               matrix (one power iteration, warm-started ``Q``)        ``<= r``; no general bound
``zfp``        ZFP fixed-rate (``rate`` bits per value, ``zfpy``)      ``2**(6 - rate) * max|x|``
                                                                       (empirical, 1-D)
=============  ======================================================  ===================================

Lossy codecs compute in float32 and decode back to the input dtype; they accept floating tensors only.
``get_codec("int8", block=32)`` or ``get_codec("int8:block=32")`` builds one; an unknown name lists the valid.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = [
    "Packet",
    "Codec",
    "NoneCodec",
    "Bf16Codec",
    "Fp16Codec",
    "Int8Codec",
    "Int4Codec",
    "TopKCodec",
    "PowerSGDCodec",
    "ZfpCodec",
    "ZstdCodec",
    "CODECS",
    "get_codec",
    "codec_names",
]

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class Packet:
    """An encoded tensor: the wire bytes plus what they decode to.

    Attributes:
        codec: name of the codec that made it.
        data: 1-D contiguous ``torch.uint8`` tensor, the bytes that travel.
        shape: shape of the decoded tensor.
        dtype: dtype of the decoded tensor.
    """

    codec: str
    data: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return int(self.data.numel())

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the decoded tensor (what an uncompressed transfer would carry)."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def ratio(self) -> float:
        """Compression ratio ``raw / wire`` (``inf`` for an empty packet of a non-empty tensor)."""
        return self.raw_nbytes / self.nbytes if self.nbytes else (1.0 if not self.raw_nbytes else math.inf)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="cpu").element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` from the front of the uint8 tensor ``b`` (a view when aligned)."""
    n = count * _itemsize(dtype)
    if b.numel() < n:
        raise ValueError(f"packet holds {b.numel()} bytes but {n} are needed for {count} x {dtype}; "
                         f"the packet was cut short or decoded with the wrong shape/codec")
    head = b[:n]
    if head.data_ptr() % _itemsize(dtype):  # unaligned slice of a larger receive buffer
        head = head.clone()
    return head.view(dtype)


class Codec(abc.ABC):
    """A tensor codec. Subclasses implement :meth:`_encode` / :meth:`_decode` on a flat tensor.

    Attributes:
        name: registry name (``get_codec(name)``).
        lossless: whether ``decode(encode(x))`` is bit-exact.
        floats_only: whether non-floating dtypes are rejected.
    """

    name: str = "?"
    lossless: bool = False
    floats_only: bool = True

    def encode(self, tensor: torch.Tensor) -> Packet:
        """Encode ``tensor`` (any shape; read through ``.detach()``) into a :class:`Packet`."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"codec {self.name!r} encodes torch tensors, got {type(tensor).__name__}; "
                            f"wrap numpy arrays with torch.from_numpy")
        if self.floats_only and tensor.dtype not in _FLOATS:
            raise TypeError(f"codec {self.name!r} is lossy and takes floating tensors, got {tensor.dtype}; "
                            f"use codec 'none' or 'zstd' for integer data")
        x = tensor.detach()
        shape = tuple(x.shape)
        if x.numel() == 0:
            return Packet(self.name, torch.empty(0, dtype=torch.uint8, device=x.device), shape, x.dtype)
        data = self._encode(x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1), shape)
        return Packet(self.name, data, shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        """Decode a packet to a new tensor of its shape and dtype."""
        if packet.codec != self.name:
            raise ValueError(f"packet was made by codec {packet.codec!r}, not {self.name!r}; "
                             f"decode it with get_codec({packet.codec!r})")
        n = math.prod(packet.shape)
        if n == 0:
            return torch.empty(packet.shape, dtype=packet.dtype, device=packet.data.device)
        flat = self._decode(packet.data, n, packet.dtype, packet.shape)
        return flat.reshape(packet.shape)

    def from_wire(self, data: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> Packet:
        """A packet from received bytes whose shape and dtype the receiver knows."""
        return Packet(self.name, data.reshape(-1), tuple(int(s) for s in shape), dtype)

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """``decode(encode(tensor))``: what a receiver sees."""
        return self.decode(self.encode(tensor))

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        """Encoded size of ``numel`` elements when it is fixed by the codec, else ``None``."""
        return None

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Per-element bound on ``|roundtrip(x) - x|`` for a float32/float64 ``x`` (the module table), as
        float64; ``None`` when the codec has no a-priori bound (PowerSGD)."""
        return torch.zeros(tensor.shape, dtype=torch.float64, device=tensor.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def state_dict(self) -> dict[str, Any]:
        """State carried from one call to the next (checkpointed, so a resumed run continues bit-exactly);
        empty for stateless codecs."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"codec {self.name!r} is stateless but was given state {sorted(state)}")

    @abc.abstractmethod
    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor: ...

    @abc.abstractmethod
    def _decode(self, data: torch.Tensor, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...


class NoneCodec(Codec):
    """No compression: the raw bytes (any dtype)."""

    name = "none"
    lossless = True
    floats_only = False

    def _encode(self, flat, shape):
        return _as_bytes(flat).clone()

    def _decode(self, data, n, dtype, shape):
        return _from_bytes(data, dtype, n).clone()

    def wire_bytes(self, numel, dtype=torch.float32):
        return numel * _itemsize(dtype)


class _CastCodec(Codec):
    target: torch.dtype = torch.bfloat16

    def _encode(self, flat, shape):
        return _as_bytes(flat.to(self.target))

    def _decode(self, data, n, dtype, shape):
        return _from_bytes(data, self.target, n).to(dtype)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 2 * numel


class Bf16Codec(_CastCodec):
    """Round to bfloat16 (8 exponent bits: no overflow; relative error ``<= 2**-8``)."""

    name = "bf16"
    target = torch.bfloat16

    def error_bound(self, tensor):
        return tensor.detach().double().abs() * 2.0**-8


class Fp16Codec(_CastCodec):
    """Round to float16 (relative error ``<= 2**-11``; magnitudes above 65504 saturate instead of becoming inf)."""

    name = "fp16"
    target = torch.float16

    def _encode(self, flat, shape):
        return _as_bytes(flat.float().clamp(-65504.0, 65504.0).to(torch.float16))

    def error_bound(self, tensor):
        a = tensor.detach().double().abs()
        return a * 2.0**-11 + 2.0**-25 + (a - 65504.0).clamp(min=0)


class _BlockCodec(Codec):
    """Blockwise absmax quantization: per block one fp32 scale ``max|B| / qmax``, codes ``round(x / scale)``.

    Wire layout: ``[scales: nblocks x fp32][codes]``. Encode and decode stream over chunks of
    :attr:`chunk_elements` elements, writing straight into the output buffer: whole-tensor temporaries cost more
    in fresh-page faults than the arithmetic itself (figures in the README's compression section).
    """

    qmax: int = 127
    chunk_elements: int = 1 << 17
    """Elements per streaming chunk (512 KiB of fp32: cache-sized temporaries, few Python iterations)."""

    def __init__(self, block: int = 64):
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"{self.name}: block={block!r} must be a positive integer (elements per scale)")
        if self.qmax == 7 and block % 2:
            raise ValueError(f"int4: block={block} must be even (two 4-bit codes share a byte); use {block + 1}")
        self.block = block
        self.chunk_blocks = max(1, self.chunk_elements // block)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"

    def _code_bytes(self, elements: int) -> int:
        return elements if self.qmax == 127 else elements // 2

    def wire_bytes(self, numel, dtype=torch.float32):
        nb = -(-numel // self.block)
        return 4 * nb + (numel if self.qmax == 127 else nb * self.block // 2)

    def error_bound(self, tensor):
        flat = tensor.detach().reshape(-1).double()
        n = flat.numel()
        if n == 0:
            return torch.zeros(tensor.shape, dtype=torch.float64, device=tensor.device)
        nb = -(-n // self.block)
        xb = torch.cat([flat, flat.new_zeros(nb * self.block - n)]).view(nb, self.block)
        amax = xb.abs().amax(dim=1, keepdim=True)
        # half a quantization step, plus float32 rounding of x / scale and q * scale
        b = amax / (2 * self.qmax) + amax * 2.0**-20
        return b.expand(nb, self.block).reshape(-1)[:n].reshape(tensor.shape).clone()

    def _encode_blocks(self, xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        """Quantize ``xb`` ``[m, block]`` fp32 into ``scales`` ``[m]`` and ``codes`` (uint8 bytes)."""
        amax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_())  # not abs(): that allocates a block-sized temporary
        torch.div(amax, self.qmax, out=scales)
        inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        q = torch.mul(xb, inv[:, None]).round_().clamp_(-self.qmax, self.qmax)
        if self.qmax == 127:
            codes.view(torch.int8).copy_(q.view(-1))
        else:  # two codes (offset by 8, so 1..15) per byte: low nibble first
            q = q.add_(8).view(-1, 2)
            codes.copy_(torch.add(q[:, 0], q[:, 1], alpha=16))

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize ``codes`` of ``m`` blocks into ``out`` ``[m, block]`` fp32."""
        if self.qmax == 127:
            torch.mul(codes.view(torch.int8).view(out.shape), scales[:, None], out=out)
        else:
            o = out.view(-1, 2)
            o[:, 0].copy_(codes & 0x0F)
            o[:, 1].copy_(codes >> 4)
            out.sub_(8).mul_(scales[:, None])

    def _encode(self, flat, shape):
        n, blk = flat.numel(), self.block
        nb, nfull = -(-n // blk), n // blk
        out = torch.empty(self.wire_bytes(n), dtype=torch.uint8, device=flat.device)
        scales = out[: 4 * nb].view(torch.float32)
        codes = out[4 * nb:]
        x = flat if flat.dtype == torch.float32 else flat.float()
        for b0 in range(0, nfull, self.chunk_blocks):
            b1 = min(nfull, b0 + self.chunk_blocks)
            self._encode_blocks(x[b0 * blk:b1 * blk].view(b1 - b0, blk), scales[b0:b1],
                                codes[self._code_bytes(b0 * blk):self._code_bytes(b1 * blk)])
        if nfull < nb:  # the last, partial block: zero padded (int8 sends only the real codes)
            tail = torch.cat([x[nfull * blk:], x.new_zeros(nb * blk - n)]).view(1, blk)
            buf = torch.empty(self._code_bytes(blk), dtype=torch.uint8, device=flat.device)
            self._encode_blocks(tail, scales[nfull:], buf)
            rest = codes[self._code_bytes(nfull * blk):]
            rest.copy_(buf[: rest.numel()])
        return out

    def _decode(self, data, n, dtype, shape):
        blk = self.block
        nb, nfull = -(-n // blk), n // blk
        scales = _from_bytes(data, torch.float32, nb)
        codes = data[4 * nb:]
        out = torch.empty(nb * blk, dtype=torch.float32, device=data.device)
        for b0 in range(0, nfull, self.chunk_blocks):
            b1 = min(nfull, b0 + self.chunk_blocks)
            self._decode_blocks(codes[self._code_bytes(b0 * blk):self._code_bytes(b1 * blk)], scales[b0:b1],
                                out[b0 * blk:b1 * blk].view(b1 - b0, blk))
        if nfull < nb:
            buf = torch.zeros(self._code_bytes(blk), dtype=torch.uint8, device=data.device)
            rest = codes[self._code_bytes(nfull * blk):self._code_bytes(nfull * blk) + self._code_bytes(blk)]
            buf[: rest.numel()] = rest
            self._decode_blocks(buf, scales[nfull:], out[nfull * blk:].view(1, blk))
        out = out[:n]
        return out if dtype == torch.float32 else out.to(dtype)


class Int8Codec(_BlockCodec):
    """Blockwise absmax int8: ``(4 + block) / block`` bytes per element; error ``<= max|B| / 254``."""

    name = "int8"
    qmax = 127


class Int4Codec(_BlockCodec):
    """Blockwise absmax 4-bit (codes in ``[-7, 7]``, two per byte); error ``<= max|B| / 14``."""

    name = "int4"
    qmax = 7

    def __init__(self, block: int = 32):
        super().__init__(block)


class TopKCodec(Codec):
    """Keep the ``ceil(fraction * n)`` largest-magnitude elements: ``[indices int32][values fp32]``.

    Pair it with error feedback: the dropped mass is carried to the next step instead of lost.
    """

    name = "topk"

    def __init__(self, fraction: float = 0.01):
        if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
            raise ValueError(f"topk: fraction={fraction!r} must be in (0, 1] (share of elements kept)")
        self.fraction = float(fraction)

    def __repr__(self) -> str:
        return f"TopKCodec(fraction={self.fraction})"

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.fraction * n)))

    def _encode(self, flat, shape):
        x = flat.float()
        k = self.k(x.numel())
        idx = torch.topk(x.abs(), k, sorted=False).indices
        idx, _ = torch.sort(idx)
        return torch.cat([_as_bytes(idx.to(torch.int32)), _as_bytes(x[idx])])

    def _decode(self, data, n, dtype, shape):
        k = self.k(n)
        idx = _from_bytes(data, torch.int32, k).long()
        val = _from_bytes(data[4 * k:], torch.float32, k)
        out = torch.zeros(n, dtype=torch.float32, device=data.device)
        out[idx] = val
        return out.to(dtype)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 8 * self.k(numel) if numel else 0

    def error_bound(self, tensor):
        return tensor.detach().double().abs() * (1 + 2.0**-20)


def matrix_view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix PowerSGD sees for a tensor of ``shape``.

    ``(shape[0], prod(shape[1:]))`` for tensors with two or more dims (a layer's weight, as in the PowerSGD
    paper); a 1-D tensor of ``n`` elements is viewed as a near-square ``ceil(n / c) x c`` matrix, zero padded.
    """
    if len(shape) >= 2:
        return int(shape[0]), int(math.prod(shape[1:]))
    n = int(math.prod(shape))
    c = max(1, math.isqrt(max(n - 1, 0)) + 1) if n > 1 else 1
    return -(-n // c), c


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s column space (reduced QR; zero columns stay zero-safe)."""
    if p.shape[1] == 0:
        return p
    q, r = torch.linalg.qr(p)
    # QR of a rank-deficient p leaves arbitrary directions; they are harmless (their coefficients are ~0).
    return q


class PowerSGDCodec(Codec):
    """Rank-``r`` PowerSGD (Vogels et al., 2019): ``M ~ P_hat Q^T`` with one warm-started power iteration.

    Encode: ``P = M Q_prev``; ``P_hat = orth(P)``; ``Q = M^T P_hat``; send ``[P_hat][Q]`` (fp32; fp64 for
    fp64 tensors) and keep
    ``Q`` as the next call's warm start (per matrix shape). The first ``Q`` is drawn from a generator seeded by
    the shape, so every rank starts from the same ``Q``. Layer-wise selection (paper §3): a tensor is sent
    uncompressed when its factors would not be smaller, ``(m + n) r >= m n`` (small layers), or when it is a
    1-D tensor below ``flat_min`` elements (biases, norms); large 1-D tensors (flat gradient buckets without a
    layout) are compressed as near-square matrices.
    Exact for matrices of rank ``<= r`` (``P_hat`` then spans ``M``'s column space).

    The compressed allreduce uses the same factors but sums ``P`` and ``Q`` across ranks between the two
    half-steps (see :func:`loom.compress.collectives.allreduce`), which needs only linear reductions.
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, *, seed: int = 0):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"powersgd: rank={rank!r} must be a positive integer")
        self.rank = rank
        self.seed = int(seed)
        self._q: dict[Any, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"PowerSGDCodec(rank={self.rank})"

    flat_min: int = 65536
    """1-D tensors with fewer elements (biases, norm weights) are sent raw; larger ones are flat buckets."""

    def selected(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` is compressed: its factors must be smaller than it, and a 1-D tensor
        must be a flat bucket (``>= flat_min`` elements), not a bias."""
        if len(shape) < 2 and math.prod(shape) < self.flat_min:
            return False
        m, n = matrix_view_shape(shape)
        r = min(self.rank, m, n)
        return (m + n) * r < m * n

    def warm_q(self, key: Any, n: int, r: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The warm-start ``Q`` (``n x r``) for ``key``; a shape-seeded Gaussian the first time."""
        q = self._q.get(key)
        if q is None or q.shape != (n, r) or q.dtype != dtype:
            g = torch.Generator().manual_seed(hash((self.seed, n, r)) & 0x7FFFFFFF)
            q = torch.randn(n, r, generator=g, dtype=torch.float64).to(dtype)
        if device is not None and q.device != torch.device(device):  # restored from a CPU checkpoint
            q = q.to(device)
        return q

    def store_q(self, key: Any, q: torch.Tensor) -> None:
        self._q[key] = q

    def state_dict(self) -> dict[str, Any]:
        """The warm-start ``Q`` of every matrix (key -> tensor, on the CPU)."""
        return {"q": {k: q.detach().cpu().clone() for k, q in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._q = {k: q.clone() for k, q in state.get("q", {}).items()}

    @staticmethod
    def work_dtype(dtype: torch.dtype) -> torch.dtype:
        """Factors are computed and sent in float64 for float64 tensors, else float32."""
        return torch.float64 if dtype == torch.float64 else torch.float32

    def matrix(self, flat: torch.Tensor, shape) -> torch.Tensor:
        """``flat`` (the elements of a tensor of ``shape``) as its zero-padded matrix view."""
        m, n = matrix_view_shape(shape)
        x = flat.to(self.work_dtype(flat.dtype))
        if m * n != x.numel():
            x = torch.cat([x, x.new_zeros(m * n - x.numel())])
        return x.view(m, n)

    def _encode(self, flat, shape):
        if not self.selected(shape):
            return _as_bytes(flat.to(self.work_dtype(flat.dtype))).clone()
        mat = self.matrix(flat, shape)
        m, n = mat.shape
        r = min(self.rank, m, n)
        key = ("codec", m, n)
        p_hat = orthonormalize(mat @ self.warm_q(key, n, r, mat.device, mat.dtype))
        q = mat.T @ p_hat
        self.store_q(key, q)
        return torch.cat([_as_bytes(p_hat), _as_bytes(q)])

    def _decode(self, data, n_el, dtype, shape):
        wd = self.work_dtype(dtype)
        if not self.selected(shape):
            return _from_bytes(data, wd, n_el).to(dtype)
        m, n = matrix_view_shape(shape)
        r = min(self.rank, m, n)
        isz = _itemsize(wd)
        p_hat = _from_bytes(data, wd, m * r).view(m, r)
        q = _from_bytes(data[isz * m * r:], wd, n * r).view(n, r)
        return (p_hat @ q.T).reshape(-1)[:n_el].to(dtype)

    def wire_bytes(self, numel, dtype=torch.float32):
        return None  # depends on the shape, not only the element count

    def error_bound(self, tensor):
        return None


class ZfpCodec(Codec):
    """ZFP fixed-rate (``rate`` bits per value) through ``zfpy``; float32/float64 (16-bit inputs go as fp32)."""

    name = "zfp"

    def __init__(self, rate: float = 16):
        if not (isinstance(rate, (int, float)) and 0 < rate <= 64):
            raise ValueError(f"zfp: rate={rate!r} must be in (0, 64] bits per value")
        self.rate = float(rate)
        try:
            import zfpy
        except ImportError as exc:
            raise ImportError("codec 'zfp' needs the zfpy package: pip install 'loom[compress]'") from exc
        self._zfpy = zfpy

    def __repr__(self) -> str:
        return f"ZfpCodec(rate={self.rate:g})"

    def _encode(self, flat, shape):
        a = flat.cpu()
        a = a.numpy() if a.dtype in (torch.float32, torch.float64) else a.float().numpy()
        blob = self._zfpy.compress_numpy(np.ascontiguousarray(a), rate=self.rate)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(flat.device)

    def error_bound(self, tensor):
        a = tensor.detach().double().abs()
        m = float(a.max()) if a.numel() else 0.0
        return torch.full(tensor.shape, m * 2.0 ** (6 - self.rate), dtype=torch.float64)

    def _decode(self, data, n, dtype, shape):
        a = self._zfpy.decompress_numpy(data.cpu().numpy().tobytes())
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)[:n].to(device=data.device, dtype=dtype)


class ZstdCodec(Codec):
    """Lossless Zstandard (``level``, default 1: fastest) over the raw bytes of any dtype."""

    name = "zstd"
    lossless = True
    floats_only = False

    def __init__(self, level: int = 1):
        try:
            import zstandard
        except ImportError as exc:
            raise ImportError("codec 'zstd' needs the zstandard package: pip install 'loom[compress]'") from exc
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"zstd: level={level!r} must be an integer in [-7, 22]")
        self.level = level
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def __repr__(self) -> str:
        return f"ZstdCodec(level={self.level})"

    def _encode(self, flat, shape):
        raw = _as_bytes(flat.cpu()).numpy().tobytes()
        return torch.frombuffer(bytearray(self._c.compress(raw)), dtype=torch.uint8).to(flat.device)

    def _decode(self, data, n, dtype, shape):
        raw = self._d.decompress(data.cpu().numpy().tobytes(), max_output_size=n * _itemsize(dtype))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)[:n].to(data.device)


CODECS: dict[str, Callable[..., Codec]] = {
    "none": NoneCodec,
    "bf16": Bf16Codec,
    "fp16": Fp16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopKCodec,
    "powersgd": PowerSGDCodec,
    "zfp": ZfpCodec,
    "zstd": ZstdCodec,
}


def codec_names() -> list[str]:
    """Registered codec names."""
    return list(CODECS)


def _parse_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def get_codec(name: "str | Codec", **kwargs: Any) -> Codec:
    """A codec by name, with options as keywords or in the name: ``get_codec("int8:block=32")``.

    A :class:`Codec` instance is returned as is (so APIs take a name or a codec).

    Raises:
        ValueError: unknown name (the message lists the valid ones) or a malformed option.
        TypeError: an option the codec does not take.
    """
    if isinstance(name, Codec):
        if kwargs:
            raise TypeError(f"get_codec: options {sorted(kwargs)} given with a codec instance {name!r}")
        return name
    if not isinstance(name, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(name).__name__}")
    base, _, opts = name.partition(":")
    base = base.strip().lower()
    if base not in CODECS:
        raise ValueError(f"unknown codec {base!r}; valid: {', '.join(CODECS)}")
    kw: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in opts.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"codec option {item!r} in {name!r} is not key=value (e.g. 'int8:block=32')")
        kw[key.strip()] = _parse_value(val.strip())
    kw.update(kwargs)
    try:
        return CODECS[base](**kw)
    except TypeError as exc:
        raise TypeError(f"codec {base!r} does not take options {sorted(kw)}: {exc}") from None
