"""Gradient compression with error feedback: 1-bit quantization (Seide et al., CNTK's 1-bit SGD) and top-k
sparsification (Lin et al., Deep Gradient Compression).

A codec turns a flat float32 vector made of segments (one per parameter) into bytes and back. `compress`
returns the message and leaves in the vector what the message lost (the vector minus what the receiver decodes,
`decode` or, added to a vector in place, `decode_add`): with error feedback (`ErrorFeedback`) that residual is
added to the next vector before it is compressed, and nothing a gradient carries is dropped for good, only
delayed.

- 1-bit: each element becomes its sign bit; each segment sends two reconstruction values, the mean of its
  non-negative and the mean of its negative elements, as bfloat16 (the error feedback keeps their rounding too).
  The segments are Seide's columns (`column_segments`): one per output channel, the leading axis of a weight.
  Means per whole tensor leave most of each gradient in the residual (on the digits CNN with 4 workers the
  residual stayed as large as the momentum, and accuracy fell 4 to 7 points); per output channel it stays
  within about a point of float32. A message is 4 bytes per channel plus one bit per element: about 27x fewer
  bytes than float32 on the digits CNN.
- top-k: the k = ceil(ratio * n) elements of largest magnitude are sent as int32 indices and float32 values.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

CODECS = ("none", "1bit", "topk")


class Float32:
    """No compression: the vector's float32 bytes. Nothing is lost, so `ErrorFeedback` sends a vector as it is."""

    name = "none"
    lossless = True

    def decode(self, message: np.ndarray, size: int) -> np.ndarray:
        """The vector of `size` floats a message carries."""
        return message.view(np.float32)[:size]

    def decode_add(self, message: np.ndarray, out: np.ndarray) -> None:
        """Add the vector a message carries to `out`."""
        out += message.view(np.float32)[:out.size]


def column_segments(shapes: Sequence[Sequence[int]]) -> list[int]:
    """The 1-bit segments of tensors of `shapes`, flattened one after the other: one per output channel (a row
    along the leading axis) of a tensor of 2 or more dimensions, one per vector or scalar."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    return row_segments(sizes, [int(shape[0]) if len(shape) >= 2 else 1 for shape in shapes])


def row_segments(sizes: Sequence[int], rows: Sequence[int]) -> list[int]:
    """`column_segments` of tensors given by their element counts and leading dimensions (1 for a vector)."""
    segments = []
    for size, count in zip(sizes, rows):
        count = count if size else 1
        segments += [size // count] * count
    return segments


def message_bytes(name: str, segments: Sequence[int], topk_ratio: float = 0.01) -> int:
    """The bytes of one message of codec `name` for a vector made of `segments`."""
    size = int(sum(segments))
    if name == "1bit":
        return 4 * len(segments) + (size + 7) // 8
    if name == "topk":
        return 8 * max(1, math.ceil(topk_ratio * size))
    return 4 * size


def _to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (the upper 16 bits of a float32), as uint16."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bfloat16(values: np.ndarray) -> np.ndarray:
    """bfloat16 values (uint16) as float32."""
    return (values.astype(np.uint32) << 16).view(np.float32)


class OneBit:
    """Sign bits and, per segment, the means of its non-negative and of its negative elements (bfloat16).

    The passes over the vector are native loops (runtime/onebit_kernels.py): the segments' sums, then the sign
    bits written straight into the message while each element becomes its residual, in place; decoding writes
    or adds each element's value in one pass.
    """

    name = "1bit"
    lossless = False

    def __init__(self, segments: Sequence[int]):
        from .onebit_kernels import kernels

        self.count = len(segments)
        self.bounds = np.concatenate([[0], np.cumsum(segments, dtype=np.int64)]).astype(np.int64)
        self.sizes = np.diff(self.bounds)
        kernels()  # compiled now (about a second on a loaded machine), before training, not in its first step

    def compress(self, vector: np.ndarray) -> np.ndarray:
        """The message for float32 `vector`, which becomes what the message lost (vector - decoded)."""
        from .onebit_kernels import pack_signs, segment_sums

        if vector.size != self.bounds[-1]:  # else the message's last sign bytes would go out unwritten
            raise ValueError(f"1-bit codec for {self.bounds[-1]} floats given {vector.size}")
        ups, up_sums, all_sums = segment_sums(vector, self.bounds)
        downs = self.sizes - ups
        means = np.zeros((self.count, 2))
        np.divide(up_sums, ups, out=means[:, 0], where=ups > 0)
        np.divide(all_sums - up_sums, downs, out=means[:, 1], where=downs > 0)
        coded = _to_bfloat16(means)
        header = 4 * self.count
        message = np.empty(header + (vector.size + 7) // 8, np.uint8)
        message[:header] = coded.reshape(-1).view(np.uint8)
        pack_signs(vector, self.bounds, _from_bfloat16(coded), message[header:])
        return message

    def decode(self, message: np.ndarray, size: int) -> np.ndarray:
        """The vector of `size` floats a message carries."""
        vector = np.empty(size, np.float32)
        self._unpack(message, vector, add=False)
        return vector

    def decode_add(self, message: np.ndarray, out: np.ndarray) -> None:
        """Add the vector a message carries to float32 `out`."""
        self._unpack(message, out, add=True)

    def _unpack(self, message: np.ndarray, out: np.ndarray, add: bool) -> None:
        from .onebit_kernels import unpack_values

        header = 4 * self.count
        means = _from_bfloat16(np.ascontiguousarray(message[:header]).view(np.uint16))
        unpack_values(message[header:], self.bounds, means, out, add)


class TopK:
    """The ceil(ratio * n) elements of largest magnitude: int32 indices then float32 values."""

    name = "topk"
    lossless = False

    def __init__(self, ratio: float):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def compress(self, vector: np.ndarray) -> np.ndarray:
        """The message for float32 `vector`, whose sent elements become 0 (what the message lost stays)."""
        k = max(1, math.ceil(self.ratio * vector.size))
        indices = np.argpartition(np.abs(vector), vector.size - k)[vector.size - k:].astype(np.int32)
        values = vector[indices]
        vector[indices] = 0
        return np.concatenate([indices.view(np.uint8), values.view(np.uint8)])

    def sent(self, message: np.ndarray) -> np.ndarray:
        """The indices of the elements a message carries."""
        return message[:4 * (message.size // 8)].view(np.int32)

    def decode(self, message: np.ndarray, size: int) -> np.ndarray:
        """The vector of `size` floats a message carries."""
        vector = np.zeros(size, np.float32)
        self.decode_add(message, vector)
        return vector

    def decode_add(self, message: np.ndarray, out: np.ndarray) -> None:
        """Add the vector a message carries to `out` (its indices are distinct)."""
        indices = self.sent(message)
        out[indices] += message[4 * indices.size:].view(np.float32)


def make_codec(name: str, segments: Sequence[int], topk_ratio: float = 0.01):
    """The codec called `name` (one of CODECS) for vectors made of `segments`."""
    if name == "none":
        return Float32()
    if name == "1bit":
        return OneBit(segments)
    if name == "topk":
        return TopK(topk_ratio)
    raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(CODECS)}")


class ErrorFeedback:
    """A codec whose sender keeps what each message lost and adds it to the next vector."""

    def __init__(self, codec, size: int):
        self.codec = codec
        self.residual = np.zeros(size, np.float32)

    def encode(self, vector: np.ndarray) -> np.ndarray:
        """The message for float32 `vector` plus the residual so far; the residual becomes, in place, what this
        message lost. A lossless codec's message is `vector` itself (its residual stays zero)."""
        if self.codec.lossless:
            return vector.view(np.uint8)
        self.residual += vector
        return self.codec.compress(self.residual)
