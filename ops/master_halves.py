"""The fp32 master's planes split and joined in one pass each: the weights rounded to nearest-even in bf16, the low
16 bits, and the high half's parity, 8 to a byte.

The planes are defined by `lightning_slide.master_halves` (`split`, `join`: torch ops, a pass each over the
weights, the low halves, the parities' unpacking and the join's integer steps). Here a split reads the fp32 master
and writes its planes (8 1/8 bytes an element), a join the reverse, with the same integer operations: rounding as
torch casts a non-NaN fp32 to bf16 ((bits + 0x7FFF + bit 16) >> 16), the high half the weight or one less,
whichever has the stored parity. The tests hold them equal to the torch ops, ties, signs, subnormals, infinities
and a partial last parity byte included.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._triton import Kernel, device_function, launch_options

BLOCK = 4096  # elements per program: a multiple of 8, whole parity bytes


def _noise_bytes(index, seed):
    """`lightning_slide.master_halves.noise_bytes`: lowbias32 of the index mixed with the seed, its top byte."""
    x = (index * 0x9E3779B9 + seed) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return (x >> 24).to(tl.int32)


_noise = device_function(_noise_bytes)


def _split(MASTER, WEIGHTS, LOW, PARITY, n, seed, first, BLOCK: tl.constexpr, LOW_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    lanes = tl.arange(0, 8)
    offs = rows[:, None] * 8 + lanes[None, :]
    mask = offs < n
    bits = tl.load(MASTER + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    if LOW_BITS == 8:  # rounded stochastically to 24 bits first
        bits = (bits + _noise(offs + first, seed)) & -256
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    weight = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)  # NaN as torch's CPU casts it
    tl.store(WEIGHTS + offs, weight.to(tl.int16), mask=mask)
    if LOW_BITS == 8:
        tl.store(LOW + offs, (bits >> 8).to(tl.int8), mask=mask)
    else:
        tl.store(LOW + offs, bits.to(tl.int16), mask=mask)
    packed = tl.sum(tl.where(mask, ((bits >> 16) & 1) << lanes[None, :], 0), axis=1)
    valid = tl.sum(tl.where(mask, 1 << lanes[None, :], 0), axis=1)  # a last partial byte keeps its other bits
    row_mask = rows * 8 < n
    kept = tl.load(PARITY + rows, mask=row_mask & (valid != 0xFF), other=0).to(tl.int32) & ~valid
    tl.store(PARITY + rows, (kept | packed).to(tl.uint8), mask=row_mask)


def _join(WEIGHTS, LOW, PARITY, OUT, n, BLOCK: tl.constexpr, LOW_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    lanes = tl.arange(0, 8)
    offs = rows[:, None] * 8 + lanes[None, :]
    mask = offs < n
    odd = (tl.load(PARITY + rows, mask=rows * 8 < n, other=0).to(tl.int32)[:, None] >> lanes[None, :]) & 1
    weight = tl.load(WEIGHTS + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    high = weight - ((weight ^ odd) & 1)  # the rounded weight, or one less: whichever has the parity
    low = tl.load(LOW + offs, mask=mask, other=0).to(tl.int32) & ((1 << LOW_BITS) - 1)
    tl.store(OUT + offs, ((high << 16) | (low << (16 - LOW_BITS))).to(tl.float32, bitcast=True), mask=mask)


_split_kernel = Kernel(_split)
_join_kernel = Kernel(_join)


def split(master: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, parity: torch.Tensor, seed: int = 0,
          first: int = 0) -> None:
    """`lightning_slide.master_halves.split` in one pass: the planes of fp32 `master` into `weights` (bf16), `low`
    (int16, or int8 for 24 bits rounded with the noise of `seed` from element `first` on) and `parity` (uint8, a
    bit an element, the first element at bit 0)."""
    n = master.numel()
    _split_kernel[(-(-n // BLOCK),)](master, weights.view(torch.int16), low, parity, n, seed, first, BLOCK=BLOCK,
                                     LOW_BITS=8 * low.element_size(), **launch_options(4))


def join(weights: torch.Tensor, low: torch.Tensor, parity: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`lightning_slide.master_halves.join` in one pass: the fp32 master (into `out`) of those planes."""
    n = out.numel()
    _join_kernel[(-(-n // BLOCK),)](weights.view(torch.int16), low, parity, out, n, BLOCK=BLOCK,
                                    LOW_BITS=8 * low.element_size(), **launch_options(4))
    return out
