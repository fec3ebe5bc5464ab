"""How Adam's moments are stored: fp32 (exact), bf16 with stochastic rounding, or blockwise dynamic 8-bit.

A run's `moment_precision` picks one codec per moment. Each moment of a unit is a `Packed`: its `values`
over the unit's trainable elements (fp32, bf16, or uint8 codes) and, for 8-bit, one fp32 scale per block of
`BLOCK` elements of the unit's flat buffer. The optimizer thread updates a compact moment one piece of at
most `SCRATCH_ELEMS` elements at a time: `decode` widens the piece into an fp32 scratch buffer, torch's fused
AdamW updates the fp32 master with it, and `encode` writes it back. Given the decoded moments, the master's
update is torch's AdamW's exactly; only the moments lose precision, on the write-back.

- "bf16": the moments rounded stochastically to bf16 (round-to-nearest would lose every update smaller than
  half a bf16 ulp of the moment, which is most of them once beta2 = 0.999 has averaged in many steps). The
  random bits come from a fixed table at a position set by the step, the unit, the moment and the element's
  index, so a rerun, a resume and the disk tier all round exactly alike (`noise_position`).
- "int8": blockwise dynamic quantisation as in bitsandbytes' 8-bit Adam (Dettmers et al., "8-bit Optimizers
  via Block-wise Quantization", ICLR 2022): each block of 256 elements is scaled by its absmax and every
  element is stored as an 8-bit code of a non-linear map, signed for exp_avg; exp_avg_sq is stored as its
  square root. The map is a small float (`Int8Codec`): the same relative precision at every magnitude over
  five decades below the block's absmax, which keeps small moments away from zero (a linear 8-bit code would
  round most of a block's exp_avg_sq to 0 and turn their updates into m / eps). bitsandbytes' own map is a
  table whose nearest entry takes a binary search per element: with torch ops on the CPU (`torch.bucketize`)
  that ran at 12-20 M elements/s per core, 50 times slower than the update itself, where the float code is a
  few integer operations. The square root is what the update divides by, and it spans half the decades of
  exp_avg_sq within a block, so elements far below their block's largest keep more digits
  (docs/alternatives.md has the measurements). Codes are rounded stochastically, with bf16's table: to the
  nearest code, an element of exp_avg_sq below its block's largest could not decay, since beta2 = 0.999 moves it
  by 0.1% a step and a code's step is 6-12%, so it stayed near its largest value since (a rare token's row
  after one large gradient); its updates then shrank up to threefold, and a tiny Llama with a 32k vocabulary
  tied to its head ended 2.0% above fp32's validation loss (docs/alternatives.md).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from lightning_slide.config import INT8_BLOCK, MomentPrecision
from lightning_slide.pinned import host_zeros

BLOCK = INT8_BLOCK  # int8: elements per absmax scale (bitsandbytes' block for its 8-bit blockwise optimizers)
# A compact update's piece: its fp32 moments are 256 KiB each, within a core's L2. Over one 8B block on the H200
# machine's 16 cores (16 pool threads), 8-bit moments updated at 0.60 / 1.22 / 0.94 / 0.89 G elements/s in pieces of
# 16K / 64K / 128K / 256K, bf16 ones at 1.82 / 2.84 / 2.93 / 2.39.
SCRATCH_ELEMS = 1 << 16
LARGEST_PIECE = 1 << 18  # the longest piece the bf16 noise table serves
NOISE_PERIOD = 1 << 20  # bf16: the stochastic-rounding table's length (random 16-bit values)


@dataclass(frozen=True)
class Packed:
    """One moment over a contiguous range of a unit's trainable elements."""

    values: torch.Tensor  # fp32 or bf16 moments, or uint8 codes of the dynamic map
    scales: torch.Tensor | None = None  # int8: the absmax of each block (the last one may be partial)

    def numel(self) -> int:
        return self.values.numel()

    def __getitem__(self, piece: slice) -> Packed:
        """Elements [start, stop) of the range; an int8 piece starts on a block boundary."""
        start, stop, _ = piece.indices(self.numel())
        if self.scales is None:
            return Packed(self.values[start:stop])
        if start % BLOCK:
            raise ValueError(f"An 8-bit moment piece must start on a block boundary (of {BLOCK}), not at {start}.")
        return Packed(self.values[start:stop], self.scales[start // BLOCK : -(-stop // BLOCK)])


@lru_cache(maxsize=1)
def _noise() -> torch.Tensor:
    """Random 16-bit values (int32), NOISE_PERIOD + LARGEST_PIECE of them, the same in every process."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(0, 1 << 16, (NOISE_PERIOD + LARGEST_PIECE,), generator=g, dtype=torch.int32)


def noise_position(step: int, unit: int, moment: int, index: int) -> int:
    """Where in the noise table element `index` of a unit's moment starts at `step` (a fixed mix of the four)."""
    return (index + step * 0x9E3779B1 + unit * 0x85EBCA77 + moment * 0xC2B2AE3D) % NOISE_PERIOD


# The codecs' arithmetic, in TorchScript: its interpreter runs a function's ops without Python's global lock, so
# the pool threads that update compact moments (`piece_pool`) each run on their own core while the training
# thread runs Python. Called op by op from Python instead, each of a piece's ops waits for the lock: with one
# thread spinning in Python beside it, an 8-bit update of 32M elements on two threads took 30 s against 0.1 s.
# (TorchScript takes no module constants: BLOCK arrives as `block`, and the smallest normal fp32 is spelt out.)


def _int8_values(codes: torch.Tensor, out: torch.Tensor, bits: torch.Tensor, signed: bool, shift: int) -> torch.Tensor:
    """The codes' values into `out` (fp32; `bits` is its int32 view): the map spans +-1.875 for exp_avg and
    [0, 1.9375] for the root of exp_avg_sq, of which encoding (values over their block's absmax) uses [-1, 1] and
    [0, 1]. The code's bits, shifted into an fp32's exponent and mantissa, are that value times 2^-112 (subnormal
    below 2^-126, exactly as a code below 2^-14 is): one multiplication rebiases it."""
    bits.copy_(codes)
    if signed:  # the sign to bit 31, the rest down to `shift` by an arithmetic shift, then the sign's copies cleared
        keep = -(1 << 31) + (1 << (7 + shift)) - 1
        bits.bitwise_left_shift_(24).bitwise_right_shift_(24 - shift).bitwise_and_(keep)
    else:
        bits.bitwise_left_shift_(shift)
    return out.mul_(2.0**112)


def _int8_codes(y: torch.Tensor, bits: torch.Tensor, work: torch.Tensor, signed: bool, shift: int,
                noise: torch.Tensor) -> torch.Tensor:
    """The code of each of `y` (|y| <= 1; clobbered; `bits` is its int32 view), as int32: y * 2^-112's fp32 bits
    plus `noise` (16 random bits per element) below the code's last mantissa bit, shifted down: one of the two
    codes around y, the upper with the probability of the dropped bits (a carry moves to the next binade; a value
    on a code stays there)."""
    y.mul_(2.0**-112)
    n = bits.numel()
    magnitude = torch.bitwise_and(bits, 0x7FFFFFFF, out=work[0, :n]) if signed else bits
    magnitude.add_(torch.bitwise_left_shift(noise, shift - 16, out=work[1, :n])).bitwise_right_shift_(shift)
    if signed:
        magnitude.bitwise_or_(bits.bitwise_right_shift_(24).bitwise_and_(0x80))
    return magnitude


def decode_piece(precision: str, values: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor,
                 out_bits: torch.Tensor, signed: bool, shift: int, block: int) -> torch.Tensor:
    """A piece of a moment as fp32: the stored tensor itself (fp32), or widened into `out` (`out_bits` its int32
    view)."""
    n = values.numel()
    if precision == "fp32":
        return values
    if precision == "bf16":
        return out[:n].copy_(values)
    assert scales is not None
    x = _int8_values(values, out[:n], out_bits[:n], signed, shift)
    full = n // block
    x[: full * block].view(-1, block).mul_(scales[:full].unsqueeze(1))
    if n % block:
        x[full * block :].mul_(scales[-1])
    return x if signed else x.square_()


def work_views(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The views of the 8-bit codec's int32 work room (2 x n) that `encode_piece` takes beside it: its first row
    as fp32 and all of it as fp64 (TorchScript cannot view a tensor as another dtype)."""
    return work[0].view(torch.float32), work.view(-1).view(torch.float64)


def encode_piece(precision: str, x: torch.Tensor, x_bits: torch.Tensor, values: torch.Tensor,
                 scales: torch.Tensor | None, work: torch.Tensor, work_f: torch.Tensor, work_d: torch.Tensor,
                 signed: bool, shift: int, block: int, noise: torch.Tensor, position: int) -> None:
    """Store fp32 `x` (clobbered; `x_bits` its int32 view) into a piece of a bf16 or int8 moment; `work_f` and
    `work_d` are `work_views(work)`. Both round with the noise from `position` on."""
    n = x.numel()
    if precision == "bf16":  # up in magnitude with the probability of the dropped 16 bits
        x_bits.add_(noise[position : position + n]).bitwise_and_(-65536)
        values.copy_(x)
        return
    assert scales is not None
    full = n // block
    # exp_avg_sq's magnitude is its root, rounded to nearest as IEEE (and CUDA) round it: torch's fp32 sqrt on the
    # CPU misses by an ulp for about one element in six; fp64's root rounded to fp32 does not (in `work`'s room)
    magnitudes = torch.abs(x, out=work_f[:n]) if signed else x.copy_(work_d[:n].copy_(x).sqrt_())
    torch.amax(magnitudes[: full * block].view(-1, block), dim=[1], out=scales[:full])
    x[: full * block].view(-1, block).div_(scales[:full].clamp(min=1.1754943508222875e-38).unsqueeze(1))
    if n % block:
        tail = x[full * block :]
        scales[-1] = tail.abs().max()
        tail.div_(scales[-1].clamp(min=1.1754943508222875e-38))
    values.copy_(_int8_codes(x, x_bits, work, signed, shift, noise[position : position + n]))


class MomentCodec:
    """fp32 moments as they are: decoding hands out the stored tensor itself and encoding has nothing to do."""

    precision: MomentPrecision = "fp32"
    dtype = torch.float32  # what `values` holds

    def __init__(self, moment: int) -> None:
        self.moment = moment  # 0: exp_avg (signed), 1: exp_avg_sq (non-negative)
        self.shift = 23 - (3 if moment == 0 else 4)  # int8: the fp32 mantissa bits a code drops
        self.noise = _noise() if self.precision != "fp32" else torch.empty(0, dtype=torch.int32)

    def bytes_for(self, elements: int) -> int:
        """Host bytes of this moment over `elements` (one unit's trainable range)."""
        return elements * self.dtype.itemsize

    def zeros(self, elements: int) -> Packed:
        return self.from_bytes(host_zeros(self.bytes_for(elements), torch.uint8), elements)

    def from_bytes(self, raw: torch.Tensor, elements: int, words: torch.Tensor | None = None) -> Packed:
        """The moment laid out in the bytes `raw` (a disk buffer or a mapped file): values, then scales. `words`,
        if given, is a float32 tensor over the same bytes (another mapping of the file) that the scales view,
        so that values and scales have storages of one dtype each, as torch.save needs."""
        return Packed(raw[: self.bytes_for(elements)].view(self.dtype))

    def piece_bytes(self, elements: int, start: int, n: int) -> list[tuple[int, int, int]]:
        """Where elements [start, start + n) of a moment over `elements` lie: (offset in the moment's bytes,
        bytes, offset in the bytes of that piece alone as `from_bytes` lays it out), one per contiguous part."""
        size = self.bytes_for(1)
        return [(start * size, n * size, 0)]

    def decode(self, packed: Packed, scratch: torch.Tensor) -> torch.Tensor:
        """The piece as fp32 (into `scratch` unless it is fp32 already)."""
        return scripted(decode_piece)(self.precision, packed.values, packed.scales, scratch, scratch.view(torch.int32),
                                      self.moment == 0, self.shift, BLOCK)

    def encode(self, x: torch.Tensor, packed: Packed, step: int, unit: int, index: int,
               work: torch.Tensor | None = None) -> None:
        """Store fp32 `x` (element `index` of the unit onwards, at `step`) into `packed`; `x` may be clobbered.
        `work`, if given, is int32 room for two tensors of the piece's size (2 x n or more) that the 8-bit codec
        uses instead of allocating."""
        if self.precision == "fp32":
            if x.data_ptr() != packed.values.data_ptr():
                packed.values.copy_(x)
            return
        work = self._room(work, x.numel())
        scripted(encode_piece)(self.precision, x, x.view(torch.int32), packed.values, packed.scales, work,
                               *work_views(work), self.moment == 0, self.shift, BLOCK, self.noise,
                               noise_position(step, unit, self.moment, index))

    def _room(self, work: torch.Tensor | None, n: int) -> torch.Tensor:
        """The int32 work room (2 x n): `work`, or made now where the codec uses it (int8)."""
        if work is not None:
            return work
        return torch.empty(2, n if self.precision == "int8" else 0, dtype=torch.int32)


class Bf16Codec(MomentCodec):
    precision: MomentPrecision = "bf16"
    dtype = torch.bfloat16


class Int8Codec(MomentCodec):
    """Per block of BLOCK elements, the absmax as an fp32 scale and each element divided by it as an 8-bit float
    code: exp_avg as sign, 4 exponent and 3 mantissa bits, the square root of exp_avg_sq (never negative) as 4
    exponent and 4 mantissa bits. The exponent spans the 16 binades below 1 (then subnormal steps down to
    2^-17 or 2^-18); each element takes one of the two codes around it, stochastically as bf16 rounds (the same
    table and positions), computed on its fp32 bits."""

    precision: MomentPrecision = "int8"
    dtype = torch.uint8

    def __init__(self, moment: int) -> None:
        super().__init__(moment)
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        out = torch.empty(256)
        self.qmap = _int8_values(codes, out, out.view(torch.int32), moment == 0, self.shift)  # what each code means

    def bytes_for(self, elements: int) -> int:
        """The codes (padded to 4 bytes, so that the scales after them can be read as fp32), then the scales."""
        return _codes_bytes(elements) + 4 * -(-elements // BLOCK)

    def zeros(self, elements: int) -> Packed:
        """Codes and scales in allocations of their own (torch.save keeps one dtype per storage)."""
        return Packed(host_zeros(_codes_bytes(elements), torch.uint8)[:elements], host_zeros(-(-elements // BLOCK)))

    def piece_bytes(self, elements: int, start: int, n: int) -> list[tuple[int, int, int]]:
        """The codes, then the scales of the piece's blocks (`start` on a block boundary)."""
        return [(start, n, 0), (_codes_bytes(elements) + 4 * (start // BLOCK), 4 * -(-n // BLOCK), _codes_bytes(n))]

    def from_bytes(self, raw: torch.Tensor, elements: int, words: torch.Tensor | None = None) -> Packed:
        start, blocks = _codes_bytes(elements), -(-elements // BLOCK)
        if words is None:
            return Packed(raw[:elements], raw[start : start + 4 * blocks].view(torch.float32))
        return Packed(raw[:elements], words[start // 4 : start // 4 + blocks])


def _codes_bytes(elements: int) -> int:
    return -(-elements // 4) * 4


_SCRIPTING = threading.Lock()  # one compilation at a time: the pool's threads may ask for a function together


@cache
def scripted(fn):
    """`fn` compiled by TorchScript, once per process (torch 2.13 marks torch.jit.script deprecated, in favour of
    torch.compile, which on the CPU builds C++ at run time: TorchScript needs no compiler)."""
    with _SCRIPTING, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(fn)


_CODECS: dict[str, type[MomentCodec]] = {"fp32": MomentCodec, "bf16": Bf16Codec, "int8": Int8Codec}


def codecs(precision: MomentPrecision) -> tuple[MomentCodec, MomentCodec]:
    """The codecs of (exp_avg, exp_avg_sq) for `moment_precision`."""
    return _CODECS[precision](0), _CODECS[precision](1)


def table_bytes(precision: MomentPrecision) -> int:
    """Host bytes of the tables a precision's codecs share: the stochastic-rounding noise of bf16 and int8."""
    return 4 * (NOISE_PERIOD + LARGEST_PIECE) if precision != "fp32" else 0


def moment_bytes(precision: MomentPrecision, trainable: int) -> int:
    """Host bytes of one unit's two moments over its `trainable` elements."""
    return sum(c.bytes_for(trainable) for c in codecs(precision))
