"""Scaled low-precision gradients on the wire (F13).

Before a gradient message is sent it is multiplied by a scale factor chosen from its value range
against the target dtype's range, cast to fp16 or bf16 and packed with its scale into one byte
buffer; the receiver unpacks, casts back to the gradient's dtype (fp32) and unscales before it
adds, so partial sums always accumulate in full precision. The scale is a power of two
(multiplying by it is exact) that maps the largest magnitude to about half the dtype's largest
finite value: large gradients cannot overflow, and small ones keep as many significant bits as
the range allows instead of flushing to zero.

Only gradients are compressed; parameters sent back by owners and servers stay exact.
A message that already holds inf or NaN is sent as is (they survive the cast) and counted in
``Codec.num_nonfinite``, so the problem shows in the step statistics instead of being hidden.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from phalanx.registry import Registry

SCALE_BYTES = 4  # the scale travels as one float32 after the payload
ENCODE_CHUNK = 1 << 18  # elements scaled per piece (1 MiB of float32 stays in cache)


class Codec:
    """No compression: messages are the tensors themselves."""

    name = "none"
    wire_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        self.num_nonfinite = 0  # messages with inf/NaN seen (since the last reset)
        self._scratch: dict[tuple, torch.Tensor] = {}

    def scratch_message(self, like: torch.Tensor) -> torch.Tensor:
        """A reusable receive buffer for ``like``'s message. Fresh multi-MB buffers cost page
        faults every step; only the communication thread receives, one message at a time, so
        one buffer per shape is enough (never use it for a message still being forwarded)."""
        empty = self.empty_message(like)
        key = (empty.shape, empty.dtype, empty.device)
        if key not in self._scratch:
            self._scratch[key] = empty
        return self._scratch[key]

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        """The message for ``t`` (1-D): here ``t`` itself."""
        return t

    def decode(self, message: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``like``-typed values of a message (a view or a new tensor)."""
        del like
        return message

    def empty_message(self, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer for the message of a tensor shaped like ``like``."""
        return torch.empty_like(like)

    def decode_add(self, message: torch.Tensor, t: torch.Tensor) -> None:
        """``t += values(message)`` in ``t``'s precision (one pass)."""
        t += message

    def decode_into(self, message: torch.Tensor, t: torch.Tensor) -> None:
        """``t[:] = values(message)``."""
        if message.data_ptr() != t.data_ptr():
            t.copy_(message)

    # -- point-to-point helpers used by the strategies ----------------------------------------
    def send(self, t: torch.Tensor, dst: int, group: Any) -> int:
        """Send ``t``'s message; returns the bytes put on the wire."""
        message = self.encode(t)
        dist.send(message, dst, group=group)
        return message.nbytes

    def recv_add(self, t: torch.Tensor, src: int, group: Any) -> int:
        """Receive a message and add its values to ``t`` (in ``t``'s precision)."""
        message = self.scratch_message(t)
        dist.recv(message, src, group=group)
        self.decode_add(message, t)
        return message.nbytes

    def recv_into(self, t: torch.Tensor, src: int, group: Any) -> int:
        """Receive a message and store its values in ``t``."""
        message = t if self.wire_dtype is None else self.scratch_message(t)
        dist.recv(message, src, group=group)
        self.decode_into(message, t)
        return message.nbytes


class ScaledCodec(Codec):
    """Power-of-two scaling + cast to ``wire_dtype``, packed with the scale (see module doc).

    Message layout (uint8, 1-D): payload (numel x itemsize of wire_dtype, padded to 4 bytes)
    then the scale as one float32.
    """

    wire_dtype: torch.dtype = torch.float16
    target: float = torch.finfo(torch.float16).max / 2  # largest magnitude after scaling

    def scale_for(self, t: torch.Tensor) -> float:
        """The power of two that maps ``t``'s largest finite magnitude near ``target``."""
        amax = float(torch.linalg.vector_norm(t, ord=math.inf)) if t.numel() else 0.0
        if not math.isfinite(amax):  # inf/NaN present: count it, scale by the finite values
            self.num_nonfinite += 1
            finite = t[torch.isfinite(t)]
            amax = float(finite.abs().max()) if finite.numel() else 0.0
        if amax == 0.0:
            return 1.0
        exponent = math.floor(math.log2(self.target / amax))
        return 2.0 ** max(-126, min(126, exponent))  # the scale itself must fit in float32

    def _payload_bytes(self, numel: int) -> int:
        raw = numel * torch.finfo(self.wire_dtype).bits // 8
        return -(-raw // SCALE_BYTES) * SCALE_BYTES

    def empty_message(self, like: torch.Tensor) -> torch.Tensor:
        size = self._payload_bytes(like.numel()) + SCALE_BYTES
        return torch.empty(size, dtype=torch.uint8, device=like.device)

    def _payload(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        itemsize = torch.finfo(self.wire_dtype).bits // 8
        return message[: numel * itemsize].view(self.wire_dtype)

    def _scale(self, message: torch.Tensor) -> float:
        return float(message[-SCALE_BYTES:].view(torch.float32))

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        scale = self.scale_for(t)
        message = self.empty_message(t)
        payload = self._payload(message, t.numel())
        # Scale in t's precision, then cast; in cache-sized pieces so no full-size temporary.
        for start in range(0, t.numel(), ENCODE_CHUNK):
            piece = t[start : start + ENCODE_CHUNK]
            payload[start : start + ENCODE_CHUNK].copy_(piece * scale)
        message[-SCALE_BYTES:].view(torch.float32).fill_(scale)
        return message

    def decode(self, message: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self._payload(message, like.numel()).to(like.dtype) / self._scale(message)

    def decode_add(self, message: torch.Tensor, t: torch.Tensor) -> None:
        # Promotes to t's dtype before scaling: one pass, no fp16 overflow on unscaling.
        t.add_(self._payload(message, t.numel()), alpha=1.0 / self._scale(message))

    def decode_into(self, message: torch.Tensor, t: torch.Tensor) -> None:
        t.copy_(self._payload(message, t.numel()))
        t.mul_(1.0 / self._scale(message))


CODECS: Registry[Codec] = Registry("compression")
CODECS.register("none")(Codec)


@CODECS.register("fp16")
class Fp16Codec(ScaledCodec):
    """fp16: largest magnitude mapped to about half of 65504; 11 bits of precision."""

    name = "fp16"
    wire_dtype = torch.float16


@CODECS.register("bf16")
class Bf16Codec(ScaledCodec):
    """bf16 has float32's exponent range: scaling only centres values (largest near 1), which
    keeps tiny gradients out of the subnormals; precision is 8 bits either way."""

    name = "bf16"
    wire_dtype = torch.bfloat16
    target = 1.0


def make_codec(name: str | None) -> Codec:
    return CODECS.get(name or "none")()
