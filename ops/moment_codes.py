"""Compact Adam moments coded in one pass: 8-bit codes decoded to fp32 and encoded back, both rounded stochastically.

The codes are defined by `lightning_slide.moment_codec` (`decode_piece`, `encode_piece`). 8-bit: per block of `BLOCK`
elements an fp32 absmax scale, per element an 8-bit float code of the element over its scale (exp_avg signed, the
square root of exp_avg_sq not), found on its fp32 bits. Both round with 16 random bits from a fixed table at a
position set by the step, the unit, the moment and the element, added below the last kept bit before truncating.
There each is a chain of torch ops, each a pass over the piece (the noise gathered in four more): counting each
op's reads and writes, about 350 bytes of device-memory traffic per element of an 8-bit moment update on the GPU,
about 190 for bf16. Here decoding an 8-bit moment reads a code and its scale and writes the fp32 value (5 bytes),
encoding reads the value and its noise and writes the reverse, and bf16 encoding reads the value and its noise
and writes 2 bytes, with the same integer and IEEE operations (division and square
root rounded to nearest, no fused multiply-add, no flush of subnormals), so they give the codec's bits exactly; the
tests hold them equal, edge cases included (values on a code, subnormals, zero and non-finite blocks, a partial
last block, a piece whose noise starts near the table's end).
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._triton import Kernel, interpreting, triton_interprets

ROWS = 16  # 8-bit: blocks of BLOCK elements per program
BF16_BLOCK = 4096  # bf16: elements per program
# (globals a compiled kernel reads must be constexpr)
TWO_POW_112 = tl.constexpr(5.192296858534828e33)  # rebias of a code's bits in an fp32 (moment_codec._int8_values)
TWO_POW_M112 = tl.constexpr(1.925929944387236e-34)
FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32: a zero block's scale divides as this


def _decode(CODES, SCALES, OUT, n, SIGNED: tl.constexpr, SHIFT: tl.constexpr, KEEP: tl.constexpr,
            BLOCK: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * (ROWS * BLOCK) + tl.arange(0, ROWS * BLOCK)
    mask = offs < n
    bits = tl.load(CODES + offs, mask=mask, other=0).to(tl.int32)
    # signed: the sign to bit 31, the rest down to SHIFT by an arithmetic shift, then the sign's copies cleared
    bits = ((bits << 24) >> (24 - SHIFT)) & KEEP if SIGNED else bits << SHIFT
    x = bits.to(tl.float32, bitcast=True) * TWO_POW_112
    x = x * tl.load(SCALES + offs // BLOCK, mask=mask, other=0.0)
    if not SIGNED:
        x = x * x
    tl.store(OUT + offs, x, mask=mask)


def _encode(X, CODES, SCALES, TABLE, n, position, SIGNED: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
            ROWS: tl.constexpr, PERIOD: tl.constexpr, PIECE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    within = offs % PIECE  # each piece of the CPU path draws from (its start + position) mod PERIOD onwards
    noise = tl.load(TABLE + ((offs - within + position) % PERIOD + within), mask=mask, other=0)
    x = tl.load(X + offs, mask=mask, other=0.0)
    if not SIGNED:  # the root of exp_avg_sq is its own magnitude
        x = tl.sqrt_rn(x)
    scale = tl.max(tl.abs(x), axis=1)
    scale = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), scale)  # amax propagates NaN
    tl.store(SCALES + rows, scale, mask=rows * BLOCK < n)
    y = tl.math.div_rn(x, tl.where(scale < FLT_MIN, FLT_MIN, scale)[:, None]) * TWO_POW_M112
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF if SIGNED else bits
    magnitude = (magnitude + (noise << (SHIFT - 16))) >> SHIFT  # up with the dropped bits' probability
    if SIGNED:
        magnitude = magnitude | ((bits >> 24) & 0x80)
    tl.store(CODES + offs, magnitude.to(tl.uint8), mask=mask)


_decode_kernel = Kernel(_decode)
_encode_kernel = Kernel(_encode)


def _options() -> dict:
    """Compiled: IEEE arithmetic as torch's kernels do it (no a * b + c contracted to one rounding, subnormals
    kept). The interpreter computes in numpy, which is IEEE already, and takes no options."""
    return {} if triton_interprets() else {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False}


def _encode_bf16(X, OUT, TABLE, n, position, PERIOD: tl.constexpr, PIECE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    within = offs % PIECE  # each piece of the CPU path draws from (its start + position) mod PERIOD onwards
    noise = tl.load(TABLE + ((offs - within + position) % PERIOD + within), mask=mask, other=0)
    x = tl.load(X + offs, mask=mask, other=0.0)
    bits = ((x.to(tl.int32, bitcast=True) + noise) & -65536) >> 16  # up with the dropped bits' probability
    tl.store(OUT + offs, tl.where(x != x, 0x7FC0, bits).to(tl.int16), mask=mask)  # NaN as torch's CPU casts it


_encode_bf16_kernel = Kernel(_encode_bf16)


def _grid(n: int, block: int) -> tuple[int]:
    return (-(-n // (ROWS * block)),)


def applies(device: torch.device) -> bool:
    """The kernels run for tensors on `device`: CUDA, or the CPU under Triton's interpreter (as `use_triton`)."""
    if device.type == "cuda":
        return not triton_interprets()
    return device.type == "cpu" and interpreting()


def decode_int8(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, signed: bool, shift: int,
                block: int) -> torch.Tensor:
    """`out[:n]` = the moment that `codes` (uint8, n) and `scales` (fp32, one per `block` elements) hold."""
    n = codes.numel()
    keep = -(1 << 31) + (1 << (7 + shift)) - 1
    _decode_kernel[_grid(n, block)](codes, scales, out, n, SIGNED=signed, SHIFT=shift, KEEP=keep, BLOCK=block,
                                    ROWS=ROWS, **_options())
    return out[:n]


def encode_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool, shift: int,
                block: int, table: torch.Tensor, position: int, period: int, piece: int) -> None:
    """Store fp32 `x` (n) as `codes` (uint8, n) and `scales` (one per `block` elements), rounded with `table`'s
    noise as `encode_bf16` draws it; `x` is left as it was."""
    n = x.numel()
    _encode_kernel[_grid(n, block)](x, codes, scales, table, n, position, SIGNED=signed, SHIFT=shift, BLOCK=block,
                                    ROWS=ROWS, PERIOD=period, PIECE=piece, **_options())


def encode_bf16(x: torch.Tensor, values: torch.Tensor, table: torch.Tensor, position: int, period: int,
                piece: int) -> None:
    """Store fp32 `x` (n) into bf16 `values`, rounded with `table`'s noise: element e of the chunk takes entry
    ((e - e % piece + position) % period + e % piece), as the CPU path's pieces of `piece` elements draw it."""
    n = x.numel()
    _encode_bf16_kernel[(-(-n // BF16_BLOCK),)](x, values.view(torch.int16), table, n, position, PERIOD=period,
                                                PIECE=piece, BLOCK=BF16_BLOCK, **_options())
