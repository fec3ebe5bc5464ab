"""The fp32 master of a unit that the GPU updates, held on the host as planes: the compute weights and the low halves.

Why: an update on the GPU moves the unit's master up and back over PCIe every step, 4 bytes an element each way,
two thirds of what crosses the link with 8-bit moments. The unit's GPU slot already holds the master rounded to
nearest-even in bf16: that is the master's high half, or the high half plus one where the low half rounded it up.
Which of the two is the high half's parity, so with the low half (2 bytes) and that bit the device has the whole
master back, exactly. A resident unit's update then moves 2 1/8 bytes of master each way instead of 4, and its new
weights stay in the slot (the host's weights plane is written back when the slot is given up or the state is
read); a unit without a slot moves its weights plane as well, and a load of it copies 2 bytes (no cast) instead of 4.

Layout, in the unit's own master buffer (4 bytes an element, so nothing more of RAM), chunk by chunk (the GPU
updater's chunks): a chunk's weights (bf16), then its low halves (int16), in the chunk's own bytes; the parities
packed 8 to a byte (element e at bit e % 8 of byte e // 8) in a buffer of their own, 1/8 byte an element. The
module's parameters are views of the fp32 master, so the planes live only while training runs: the GPU turns each
chunk into planes at a step's start and back when the state is read (the engine's `synchronize`), in place, at the
link's speed (`DeviceUpdater.convert`).

With `master_bits=24` (opt-in, not exact) the low plane keeps only the next 8 bits: the split rounds the master
stochastically to 24 bits (bf16 and an 8-bit compensation; the low 8 bits cleared, the value rounded up with the
probability they gave), which moves 1 1/8 bytes of master each way instead of 2 1/8. The rounding noise is a hash
of the element's index in its unit, the step and the unit (`noise_bytes`), so a rerun and a resume round alike.

`split` and `join` are the definition, in torch ops on any device; `ops.master_halves` is the same in one Triton
pass each, bit for bit. A NaN master joins as a NaN (its payload may change); every other value comes back exact
(with 24 bits: as rounded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from lightning_slide.pinned import host_zeros, pin_, unpin_

_GATHER = 0x0102040810204080  # x * this >> 56: the low bits of x's 8 bytes, byte i at bit i
_SPREAD = 0x0101010101010101  # a byte copied into each of 8
_PICK = 0x8040201008040201 - (1 << 64)  # ... and bit i kept in byte i (as a signed int64)

assert sys.byteorder == "little", "the planes are read off the fp32 master's bytes in little-endian order"


def plane_bits(dtype: torch.dtype, gradient_chunk: int, largest_trainable: int, master_bits: int) -> int | None:
    """The bits of their masters (`master_bits`) that the units the GPU updates keep as planes, or None where their
    masters move whole: planes apply where weights are computed in bf16 (a slot then holds the master's high half,
    or one more) and every update starts on a whole parity byte (gradient chunks of a multiple of 8 elements, or one
    chunk a unit)."""
    applies = dtype == torch.bfloat16 and (gradient_chunk % 8 == 0 or gradient_chunk >= largest_trainable)
    return master_bits if applies else None


def parity_bytes(n: int) -> int:
    """Bytes of the parity plane over `n` elements."""
    return -(-n // 8)


LOW_DTYPES = {32: torch.int16, 24: torch.int8}  # the low plane's element, by the master's bits kept
_M32 = 0xFFFFFFFF


def require_planes(master_bits: int, plane_bits: int | None) -> None:
    """Fewer than 32 bits of master apply to the masters the GPU updates as planes (`plane_bits`: None where the
    run has none)."""
    if master_bits != 32 and plane_bits is None:
        raise ValueError(
            f"SlideConfig.master_bits={master_bits} keeps that many bits of the masters the GPU updates as planes: a "
            "CUDA run computing in bf16 (precision='bf16-mixed' or 'bf16-true') whose updates run on the GPU "
            "(moment_precision 'int8' or 'bf16', or gpu_update_blocks above 0), with chunk_elems a multiple of 8. "
            "This run updates no master that way: set master_bits=32.")


def seed(step: int, unit: int) -> int:
    """The rounding noise's seed for `unit`'s split at `step` (`noise_bytes`)."""
    return (step * 0x9E3779B1 + unit * 0x85EBCA77 + 0x165667B1) & _M32


def noise_bytes(first: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """8 random bits (int32, 0..255) for elements first .. first + n - 1 of a unit: the top byte of a 32-bit integer
    hash (lowbias32) of the element's index mixed with `seed`, in int64 arithmetic kept to 32 bits, as the Triton
    split computes it."""
    x = (torch.arange(first, first + n, dtype=torch.int64, device=device) * 0x9E3779B9 + seed) & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return (x >> 24).to(torch.int32)


def split(master: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, parity: torch.Tensor, seed: int = 0,
          first: int = 0) -> None:
    """The planes of the fp32 `master` (n elements, the first at bit 0 of `parity`'s first byte): `weights` (bf16,
    rounded to nearest-even as torch casts), `low` (int16: the low 16 bits), `parity` (uint8, `parity_bytes(n)`:
    the high halves' parities; a last partial byte keeps its bits past n). An int8 `low` keeps bits 8-15 of the
    master rounded stochastically to 24 bits (`noise_bytes(first, n, seed)` added below bit 8, those bits then
    cleared), which the weights and parities are then taken from."""
    n = master.numel()
    if low.dtype == torch.int8:
        bits = master.view(torch.int32) + noise_bytes(first, n, seed, master.device)
        master = bits.bitwise_and_(-256).view(torch.float32)  # a carry rounds the magnitude up; NaN, inf stay
    weights.copy_(master)
    low.copy_(master.view(torch.int32) >> (8 if low.dtype == torch.int8 else 0))  # the cast keeps the low bits
    whole = n // 8 * 8
    if whole:  # bit 16 of an element is bit 0 of its third byte
        bits = master[:whole].view(torch.uint8).view(-1, 4)[:, 2] & 1
        parity[: whole // 8].copy_((bits.view(torch.int64) * _GATHER) >> 56)
    if whole < n:
        rest = (master[whole:].view(torch.int32) >> 16) & 1
        ones = torch.arange(n - whole, dtype=torch.int32, device=master.device)
        kept = parity[whole // 8] & ((0xFF << (n - whole)) & 0xFF)
        parity[whole // 8] = kept | (rest << ones).sum().to(torch.uint8)


def join(weights: torch.Tensor, low: torch.Tensor, parity: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 master (into `out`, n elements) whose planes `split` wrote."""
    n = out.numel()
    spread = (parity[: parity_bytes(n)].to(torch.int64) * _SPREAD) & _PICK
    odd = (spread.view(torch.uint8)[:n] != 0).to(torch.int32)
    w = weights.view(torch.int16).to(torch.int32) & 0xFFFF
    high = w - ((w ^ odd) & 1)  # the rounded weight, or one less: whichever has the high half's parity
    below = (low.to(torch.int32) & 0xFF) << 8 if low.dtype == torch.int8 else low.to(torch.int32) & 0xFFFF
    out.view(torch.int32).copy_((high << 16) | below)
    return out


class MasterHalves:
    """The planes of one unit's fp32 `master` buffer (pinned host memory), and where its newest weights are.

    The buffer is cut into chunks of `chunk` elements (a multiple of 8: whole parity bytes); a chunk's planes take
    its own bytes, its weights first, then its low parts (`low_dtype`: int16, or int8 keeping 24 bits; `unit`: the
    unit's index, which seeds their rounding), so that one chunk turns into planes and back without touching
    another's (`DeviceUpdater.convert`). `planes`: the buffer holds the planes (else the fp32 master, which
    the parameters view). `stale`: the weights plane is older than the unit's GPU slot, which an update on the GPU
    wrote instead; the window writes the slot back (`written_back`: the event after which the plane holds it)
    before the slot takes another unit.
    """

    def __init__(self, master: torch.Tensor, chunk: int, unit: int = 0, bits: int = 32) -> None:
        self.master, self.chunk, self.unit = master, -(-chunk // 8) * 8, unit
        self.low_dtype = LOW_DTYPES[bits]
        self._bytes = master.view(torch.uint8)
        self.parity = host_zeros(parity_bytes(master.numel()), torch.uint8)
        self.pinned = pin_(self.parity)
        self.planes = self.stale = False
        self.written_back: object = None

    def seed(self, step: int) -> int:
        """The rounding noise's seed of this unit's splits at `step` (`noise_bytes`)."""
        return seed(step, self.unit)

    def chunks(self) -> list[tuple[int, int]]:
        """(start, end) of each chunk."""
        n = self.master.numel()
        return [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]

    def pieces(self, a: int, b: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Elements [a, b) of the planes, a piece per chunk they cross: (its first element, its weights (bf16),
        its low halves (`low_dtype`))."""
        n, size = self.master.numel(), self.low_dtype.itemsize
        while a < b:
            first = a - a % self.chunk
            m = min(first + self.chunk, n) - first
            end = min(b, first + m)
            weights = 4 * first + 2 * (a - first)  # the chunk's bytes: m weights first, then its m low parts
            low = 4 * first + 2 * m + size * (a - first)
            yield (a, self._bytes[weights : weights + 2 * (end - a)].view(torch.bfloat16),
                   self._bytes[low : low + size * (end - a)].view(self.low_dtype))
            a = end

    def release(self) -> None:
        if self.pinned:
            unpin_(self.parity)
            self.pinned = False
