"""Compressed outer gradients: min-max quantization to 8 or 4 bits and top-k, with error feedback.

A codec turns a flat float tensor into a byte payload and back. Streaming DiLoCo
(:mod:`pccl.torch._streaming`) all-gathers every peer's payload and each peer decodes all of them
and averages them in rank order, so every peer computes the same bits from the same bytes: the
average is bit-identical across peers by construction, whatever the codec. Decoding is a pure
function of the payload (elementwise float32 arithmetic, no reductions), so it gives the same bits
on the encoder as on every other peer, which is what makes error feedback exact: the residual a peer
keeps, ``v - decode(encode(v))``, is exactly what its contribution lost this round.

Payload layouts (little-endian, ``n`` elements, blocks of ``block`` elements, ``b = ceil(n / block)``):

* ``MinMaxCodec(bits)``: ``b`` float32 minima, ``b`` float32 maxima, then the codes: one byte each
  (8 bits), or two per byte (4 bits, the element of even index in the low nibble). A code is
  ``floor((x - min) * (Q / (max - min)) + 0.5)``, ``Q = 2**bits - 1`` (round to nearest, no bias),
  decoded as ``q * ((max - min) / Q) + min``; a constant block decodes to its value exactly.
* ``DeflateCodec(codec, bits)``: the ``MinMaxCodec``'s ``b`` minima and maxima, then a raw deflate
  stream (RFC 1951) of its codes, zero-padded to ``ceil(n * bits / 8) + 32`` bytes: either the packed
  codes, or (4 bits) one code per byte, whichever stream is shorter; the decoder tells them apart by
  the length they inflate to. When the plain codes are no larger than that budget (``n`` of a few
  hundred), the payload is the plain codec's.
* ``TopKCodec(fraction)``: ``k = max(1, ceil(fraction * n))`` int32 indices (ascending) of the
  largest magnitudes, then their values as float32 (or as a ``MinMaxCodec`` payload of ``k``
  elements when ``bits`` is given). The other elements decode to zero.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import numpy
import torch

from .._errors import InvalidArgumentError

__all__ = ["ChunkedCodec", "Codec", "DeflateCodec", "ErrorFeedback", "MinMaxCodec", "TopKCodec",
           "average_payloads", "choose_codec", "codec_from_spec"]


class Codec(Protocol):
    """Encodes flat float32 tensors into byte payloads whose size depends on the element count only."""

    name: str

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload of ``numel`` elements."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload (a flat uint8 tensor of :meth:`payload_bytes` bytes) of the flat float32 ``x``."""
        ...

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 values of ``payload`` (a pure function of its bytes)."""
        ...


class MinMaxCodec:
    """Block-wise min-max quantization to 8 or 4 bits (see the module docstring).

    Args:
        bits: 8 or 4.
        block: elements per block (each block carries its own float32 min and max: 8 bytes).
    """

    def __init__(self, bits: int = 8, block: int = 4096) -> None:
        if bits not in (4, 8):
            raise InvalidArgumentError(f"MinMaxCodec: bits must be 4 or 8, not {bits}")
        if block < 2 or (bits == 4 and block % 2):
            raise InvalidArgumentError("MinMaxCodec: block must be >= 2 (and even for 4 bits)")
        self.bits = bits
        self.block = block
        self.qmax = (1 << bits) - 1
        self.name = f"int{bits}"

    def __repr__(self) -> str:
        return f"MinMaxCodec(bits={self.bits}, block={self.block})"

    def blocks_of(self, numel: int) -> int:
        """Blocks (min/max pairs) of ``numel`` elements."""
        return max(1, math.ceil(numel / self.block))

    def code_bytes(self, numel: int) -> int:
        """Bytes of the packed codes of ``numel`` elements."""
        return numel if self.bits == 8 else (numel + 1) // 2

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.blocks_of(numel) + self.code_bytes(numel)

    def blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(xb, lo, hi)``: the flat float32 ``x`` as ``b`` rows of ``block`` elements (the last padded
        with copies of the last element, so its min and max stay its own), and each row's min and max."""
        x = x.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        b = self.blocks_of(n)
        padded = x.new_empty(b * self.block)
        padded[:n] = x
        padded[n:] = x[-1] if n else 0.0
        xb = padded.view(b, self.block)
        return xb, xb.amin(dim=1), xb.amax(dim=1)

    def codes(self, xb: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, numel: int) -> torch.Tensor:
        """The packed codes (uint8) of the first ``numel`` elements of the rows ``xb`` quantized on each
        row's range ``[lo, hi]`` (values outside it are clamped to the nearest end)."""
        d = hi - lo
        inv = torch.where(d > 0, self.qmax / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
        q = torch.floor((xb - lo[:, None]) * inv[:, None] + 0.5).clamp_(0, self.qmax)
        q = torch.nan_to_num(q, nan=0.0).to(torch.uint8).reshape(-1)[:numel]
        if self.bits == 4:
            if numel % 2:
                q = torch.cat([q, q.new_zeros(1)])
            q = q[0::2] | (q[1::2] << 4)
        return q

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xb, lo, hi = self.blocks(x)
        head = torch.cat([lo, hi]).view(torch.uint8)
        return torch.cat([head, self.codes(xb, lo, hi, x.numel())])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if payload.dtype != torch.uint8 or payload.numel() != self.payload_bytes(numel):
            raise InvalidArgumentError(f"{self.name} payload of {numel} elements must be "
                                       f"{self.payload_bytes(numel)} bytes of uint8")
        return self.values(payload[: 8 * self.blocks_of(numel)], payload[8 * self.blocks_of(numel):], numel)

    def values(self, head: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 values of ``numel`` elements from the payload's head (the minima and maxima) and
        its packed codes."""
        b = self.blocks_of(numel)
        head = head.clone().view(torch.float32)
        lo, hi = head[:b], head[b:]
        if self.bits == 4:
            q = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:numel]
        else:
            q = codes
        step = (hi - lo) / self.qmax
        block_of = torch.arange(numel) // self.block
        return q.to(torch.float32) * step[block_of] + lo[block_of]


class DeflateCodec:
    """A :class:`MinMaxCodec`'s codes entropy-coded with raw deflate into a fixed budget of bits per
    element (see the module docstring).

    The codes of error-fed pseudo-gradients are far from uniform (most values sit near the middle of
    a block's range), so deflate stores them in fewer bits than the codec's: ~2.6-3.5 bits per 4-bit
    code in the benchmark of docs/torch.md. Every payload has the size of the budget, so the
    collectives stay fixed-size; when the codes do not fit it (rare at the default budget), the
    encoder widens each block's range (by 1.25, 1.5, 2, 3, 4, 8, 16x about its middle, the first that
    fits; at the end a constant block) until they do: coarser steps, whose error, like all the
    others, error feedback sends in the next round (:attr:`widened` counts those encodings). Decoding
    is a pure function of the payload's bytes, as for every codec.

    Args:
        codec: the quantizer (default ``MinMaxCodec(4)``).
        bits: the budget, in bits per element (default 3.6: 10 % under the 4-bit codes).
    """

    # the range factors tried in turn; 0: the block's middle value for every element
    _WIDEN = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 0.0)
    _SLACK = 32  # bytes of the budget for the deflate stream's own tables

    def __init__(self, codec: MinMaxCodec | None = None, bits: float = 3.6) -> None:
        self.codec = codec if codec is not None else MinMaxCodec(4)
        if not 0.0 < bits <= self.codec.bits:
            raise InvalidArgumentError(f"DeflateCodec: bits must be in (0, {self.codec.bits}], not {bits}")
        self.bits = bits
        self.name = self.codec.name
        self.encodes = 0  # encodings made with deflate
        self.widened = 0  # of those, encodings whose range had to be widened to fit the budget

    def __repr__(self) -> str:
        return f"DeflateCodec({self.codec!r}, bits={self.bits:g})"

    def body_bytes(self, numel: int) -> int:
        """Bytes after the minima and maxima: the budget, or the plain codes when they are no larger
        (small tensors, where the stream's tables would not pay off: then the payload is the plain
        codec's)."""
        return min(self.codec.code_bytes(numel), math.ceil(numel * self.bits / 8) + self._SLACK)

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.codec.blocks_of(numel) + self.body_bytes(numel)

    def _plain(self, numel: int) -> bool:
        return self.body_bytes(numel) == self.codec.code_bytes(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if self._plain(n):
            return self.codec.encode(x)
        cap = self.body_bytes(n)
        xb, lo, hi = self.codec.blocks(x)
        for factor in self._WIDEN:
            if factor == 1.0:
                a, b = lo, hi
            else:
                mid = lo + (hi - lo) / 2
                half = (hi - lo) * (factor / 2)
                a, b = mid - half, mid + half
            stream = self._deflate(self.codec.codes(xb, a, b, n), n, cap)
            if stream is not None:
                break
        else:  # pragma: no cover - constant codes deflate to a few bytes per 258
            raise AssertionError("constant codes did not fit the budget")
        self.encodes += 1
        self.widened += factor != 1.0
        body = torch.zeros(cap, dtype=torch.uint8)
        body[:len(stream)] = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        return torch.cat([torch.cat([a, b]).view(torch.uint8), body])

    def _deflate(self, packed: torch.Tensor, numel: int, cap: int) -> bytes | None:
        """The shorter of two raw deflate streams, if it fits ``cap`` bytes: the packed codes (level 9),
        and, for 4 bits, one code per byte with Huffman coding only (closer to the codes' entropy when
        they are independent). The decoder tells them apart by their length."""
        raw = packed.numpy().tobytes()
        best = _raw_deflate(raw, zlib.Z_DEFAULT_STRATEGY)
        if self.codec.bits == 4 and numel > 1:
            q = packed.numpy()
            one = numpy.stack([q & 0x0F, q >> 4], axis=1).reshape(-1)[:numel]
            other = _raw_deflate(one.tobytes(), zlib.Z_HUFFMAN_ONLY)
            if len(other) < len(best):
                best = other
        return best if len(best) <= cap else None

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if payload.dtype != torch.uint8 or payload.numel() != self.payload_bytes(numel):
            raise InvalidArgumentError(f"{self.name} payload of {numel} elements must be "
                                       f"{self.payload_bytes(numel)} bytes of uint8")
        if self._plain(numel):
            return self.codec.decode(payload, numel)
        head = 8 * self.codec.blocks_of(numel)
        packed_len = self.codec.code_bytes(numel)
        inflater = zlib.decompressobj(-15)
        try:
            data = inflater.decompress(payload[head:].numpy().tobytes(), numel)
            if not inflater.eof:  # stopped at numel bytes: what is left must be the stream's end
                data += inflater.decompress(inflater.unconsumed_tail, 1)
        except zlib.error as exc:
            raise InvalidArgumentError(f"{self.name} payload: a bad deflate stream ({exc})") from None
        if not inflater.eof or len(data) not in (packed_len, numel):
            raise InvalidArgumentError(f"{self.name} payload: the deflate stream does not hold {numel} codes")
        codes = numpy.frombuffer(data, dtype=numpy.uint8)
        if len(data) != packed_len:  # one 4-bit code per byte
            if int(codes.max(initial=0)) > self.codec.qmax:
                raise InvalidArgumentError(f"{self.name} payload: a code out of range")
            if numel % 2:
                codes = numpy.concatenate([codes, numpy.zeros(1, dtype=numpy.uint8)])
            codes = (codes[0::2] | (codes[1::2] << 4)).astype(numpy.uint8)
        return self.codec.values(payload[:head], torch.from_numpy(codes.copy()), numel)


def _raw_deflate(data: bytes, strategy: int) -> bytes:
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15, 9, strategy)
    return deflater.compress(data) + deflater.flush()


class TopKCodec:
    """The ``fraction`` of largest-magnitude elements, as indices and values (see the module docstring).

    Args:
        fraction: share of the elements sent, in (0, 1].
        bits: quantize the values with :class:`MinMaxCodec` (8 or 4), or None for float32 values.
    """

    def __init__(self, fraction: float, bits: int | None = None) -> None:
        if not 0.0 < fraction <= 1.0:
            raise InvalidArgumentError(f"TopKCodec: fraction must be in (0, 1], not {fraction}")
        self.fraction = fraction
        self.values = MinMaxCodec(bits, block=1024) if bits is not None else None
        self.name = f"top{fraction:g}" + (f"-int{bits}" if bits is not None else "")

    def __repr__(self) -> str:
        bits = None if self.values is None else self.values.bits
        return f"TopKCodec(fraction={self.fraction}, bits={bits})"

    def k(self, numel: int) -> int:
        """Elements sent of ``numel``."""
        return max(1, min(numel, math.ceil(self.fraction * numel)))

    def payload_bytes(self, numel: int) -> int:
        k = self.k(numel)
        return 4 * k + (4 * k if self.values is None else self.values.payload_bytes(k))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1).to(torch.float32)
        k = self.k(x.numel())
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values.to(torch.int32)
        vals = x[idx.long()]
        body = vals.view(torch.uint8) if self.values is None else self.values.encode(vals)
        return torch.cat([idx.view(torch.uint8), body])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.k(numel)
        if payload.dtype != torch.uint8 or payload.numel() != self.payload_bytes(numel):
            raise InvalidArgumentError(f"{self.name} payload of {numel} elements must be "
                                       f"{self.payload_bytes(numel)} bytes of uint8")
        idx = payload[: 4 * k].clone().view(torch.int32).long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            raise InvalidArgumentError(f"{self.name} payload: an index out of range")
        body = payload[4 * k:]
        vals = body.clone().view(torch.float32) if self.values is None else self.values.decode(body, k)
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = vals
        return out


class ChunkedCodec:
    """``codec`` applied to ``parts`` equal chunks of ``c = ceil(numel / parts)`` elements each (the last
    one padded with copies of the last element): the payload is the chunks' payloads end to end, all of
    one size, so chunk ``j``'s payload can be sent to peer ``j`` (an all-to-all) and the peers' payloads
    of one chunk laid end to end decode with the chunk's codec.

    Args:
        codec: the codec of each chunk.
        parts: the number of chunks (>= 1).
    """

    def __init__(self, codec: Codec, parts: int) -> None:
        if parts < 1:
            raise InvalidArgumentError(f"ChunkedCodec: parts must be >= 1, not {parts}")
        self.codec = codec
        self.parts = parts
        self.name = codec.name

    def __repr__(self) -> str:
        return f"ChunkedCodec({self.codec!r}, parts={self.parts})"

    def chunk(self, numel: int) -> int:
        """Elements of each chunk of ``numel``."""
        return max(1, math.ceil(numel / self.parts))

    def payload_bytes(self, numel: int) -> int:
        return self.parts * self.codec.payload_bytes(self.chunk(numel))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1).to(torch.float32)
        n, c = x.numel(), self.chunk(x.numel())
        padded = x.new_empty(self.parts * c)
        padded[:n] = x
        padded[n:] = x[-1] if n else 0.0
        return torch.cat([self.codec.encode(padded[j * c:(j + 1) * c]) for j in range(self.parts)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        c = self.chunk(numel)
        size = self.codec.payload_bytes(c)
        if payload.dtype != torch.uint8 or payload.numel() != self.parts * size:
            raise InvalidArgumentError(f"{self.name} payload of {numel} elements in {self.parts} chunks "
                                       f"must be {self.parts * size} bytes of uint8")
        parts = [self.codec.decode(payload[j * size:(j + 1) * size], c) for j in range(self.parts)]
        return torch.cat(parts)[:numel]


def codec_from_spec(spec: str | Codec | None) -> Codec | None:
    """A codec from its name: None or ``"fp32"`` (no compression), ``"int8"`` (``MinMaxCodec(8)``),
    ``"int4"`` (``DeflateCodec(MinMaxCodec(4))``: 3.6 bits per element), ``"int4-plain"``
    (``MinMaxCodec(4)``), ``"topk:F"`` (top-k, fraction F), ``"topk:F:int4"``; a codec object is
    returned as it is.

    Raises:
        InvalidArgumentError: an unknown name.
    """
    if spec is None or spec == "fp32":
        return None
    if not isinstance(spec, str):
        return spec
    if spec == "int4":
        return DeflateCodec(MinMaxCodec(4))
    if spec in ("int8", "int4-plain"):
        return MinMaxCodec(int(spec[3]))
    parts = spec.split(":")
    if parts[0] == "topk" and len(parts) in (2, 3):
        try:
            fraction = float(parts[1])
            bits = int(parts[2][3:]) if len(parts) == 3 and parts[2].startswith("int") else None
        except ValueError:
            raise InvalidArgumentError(f"bad codec {spec!r}") from None
        if len(parts) == 3 and bits is None:
            raise InvalidArgumentError(f"bad codec {spec!r}")
        return TopKCodec(fraction, bits)
    raise InvalidArgumentError(
        f"unknown codec {spec!r}: use fp32, int8, int4, int4-plain, topk:F or topk:F:int4")


# The candidates of choose_codec, least lossy first.
_LADDER: tuple[str, ...] = ("fp32", "int8", "int4", "topk:0.25:int4", "topk:0.1:int4", "topk:0.03:int4",
                            "topk:0.01:int4")


def wire_bytes(codec: Codec | None, numel: int, element_size: int, world_size: int) -> int:
    """Bytes one peer sends to average ``numel`` elements over ``world_size`` peers.

    Uncompressed: a ring all-reduce, ``2 (n - 1) / n`` of the tensor; compressed, 2 peers: an
    all-gather of the payloads (one payload); compressed, ``n >= 3`` peers: the two-stage exchange of
    :mod:`pccl.torch._streaming` (an all-to-all of ``n - 1`` chunk payloads, an all-gather of ``n - 1``
    reduced-chunk payloads: ``2 (n - 1)`` payloads of ``ceil(numel / n)`` elements).
    """
    n = max(1, world_size)
    if codec is None:
        return 2 * (n - 1) * numel * element_size // n
    if n >= 3:
        return 2 * (n - 1) * codec.payload_bytes(math.ceil(numel / n))
    return (n - 1) * codec.payload_bytes(numel)


def choose_codec(numel: int, element_size: int, world_size: int, budget_bytes: int) -> Codec | None:
    """The least lossy codec of the ladder fp32, int8, int4, top-k 25/10/3/1 % (int4 values) whose
    :func:`wire_bytes` fit ``budget_bytes`` (the last one when none fits). A pure function of its
    arguments, so every peer of a group chooses the same.
    """
    choice: Codec | None = None
    for spec in _LADDER:
        choice = codec_from_spec(spec)
        if wire_bytes(choice, numel, element_size, world_size) <= budget_bytes:
            return choice
    return choice


def average_payloads(codec: Codec, gathered: torch.Tensor, world_size: int, numel: int) -> torch.Tensor:
    """The average of ``world_size`` payloads laid end to end in ``gathered`` (rank order), in float32.

    Summed in rank order, then divided: the same bits on every peer that holds the same bytes.
    """
    size = codec.payload_bytes(numel)
    if gathered.numel() != world_size * size:
        raise InvalidArgumentError(f"expected {world_size} payloads of {size} bytes, got {gathered.numel()}")
    acc = codec.decode(gathered[:size], numel)
    for r in range(1, world_size):
        acc += codec.decode(gathered[r * size:(r + 1) * size], numel)
    return acc / world_size


class ErrorFeedback:
    """A codec with a residual: what this peer's contribution lost is added to its next one.

    ``encode(g)`` sends ``v = g + residual`` and proposes ``v - decode(encode(v))`` as the new
    residual; :meth:`commit` keeps it (the round was applied), :meth:`discard` keeps the old one (the
    round was lost: the next pseudo-gradient measures again what was not applied). Over rounds the
    decoded contributions add up to the inputs' sum minus the last residual, which is bounded by half
    a quantization step (of the widened step where a ``DeflateCodec`` widened the range; top-k: by the
    elements not yet sent): no bias accumulates.

    Args:
        codec: the codec.
        numel: elements of the tensors encoded.
    """

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self._proposed: torch.Tensor | None = None

    def encode(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, decoded)`` of ``g + residual``; the new residual waits for :meth:`commit`."""
        v = g.detach().reshape(-1).to(torch.float32) + self.residual
        payload = self.codec.encode(v)
        decoded = self.codec.decode(payload, v.numel())
        self._proposed = v - decoded
        return payload, decoded

    def commit(self) -> None:
        """The round was applied: keep the proposed residual."""
        if self._proposed is not None:
            self.residual = self._proposed
            self._proposed = None

    def discard(self) -> None:
        """The round was lost: keep the previous residual."""
        self._proposed = None
