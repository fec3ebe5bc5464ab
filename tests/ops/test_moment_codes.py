"""The compact moments' kernels give the codec's torch ops' bits (`moment_codec.encode_piece`, `decode_piece`)."""
import pytest
import torch

from lightning_slide.moment_codec import (
    BLOCK,
    NOISE_PERIOD,
    Bf16Codec,
    Int8Codec,
    decode_piece,
    encode_piece,
    work_views,
)
from lightning_slide.ops.moment_codes import decode_int8, encode_bf16, encode_int8

MOMENTS = [0, 1]
IDS = ["exp_avg", "exp_avg_sq"]


def _moment(moment: int, n: int, device: str) -> torch.Tensor:
    """Magnitudes over 40 decades in random order (subnormals and blocks of very unequal elements included), values
    on and halfway between codes (simple fractions of the block's absmax), a zero block, and a partial last
    block."""
    g = torch.Generator().manual_seed(n + moment)
    x = torch.randn(n, generator=g) * torch.logspace(-40, 2, n)[torch.randperm(n, generator=g)]
    x[:BLOCK] = torch.arange(BLOCK) / 64.0 - 2.0  # multiples of 1/64 of the absmax: many ties
    x[BLOCK : 2 * BLOCK] = 0.0
    x[2 * BLOCK : 3 * BLOCK] *= 1e-38 / x[2 * BLOCK : 3 * BLOCK].abs().max()  # a block of subnormals only
    return (x if moment == 0 else x.square()).to(device)


PIECE = 2 * BLOCK  # the CPU path's pieces here: each draws its rounding noise from its own position on


def _encode_reference(x: torch.Tensor, moment: int, position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's torch ops, piece by piece as the CPU path runs them."""
    codec, n = Int8Codec(moment), x.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-n // BLOCK), device=x.device)
    table = codec.noise.to(x.device)
    for a in range(0, n, PIECE):
        part = x[a : a + PIECE].clone()
        work = torch.empty(2, part.numel(), dtype=torch.int32, device=x.device)
        piece_scales = scales[a // BLOCK :][: -(-part.numel() // BLOCK)]
        encode_piece("int8", part, part.view(torch.int32), codes[a : a + PIECE], piece_scales, work, *work_views(work),
                     moment == 0, codec.shift, BLOCK, table, (position + a) % NOISE_PERIOD)
    return codes, scales


def _encode(x: torch.Tensor, moment: int, position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-x.numel() // BLOCK), device=x.device)
    encode_int8(x, codes, scales, moment == 0, Int8Codec(moment).shift, BLOCK, Int8Codec(moment).noise.to(x.device),
                position, NOISE_PERIOD, PIECE)
    return codes, scales


@pytest.mark.parametrize("moment", MOMENTS, ids=IDS)
@pytest.mark.parametrize("n", [7 * BLOCK, 40 * BLOCK + 37], ids=["whole-blocks", "partial-last-block"])
@pytest.mark.parametrize("position", [0, NOISE_PERIOD - 300], ids=["start", "near-the-tables-end"])
def test_encoding_gives_the_codecs_codes_and_scales(moment, n, position, device):
    x = _moment(moment, n, device)
    before = x.clone()
    codes, scales = _encode(x, moment, position)
    expected_codes, expected_scales = _encode_reference(x, moment, position)
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales.view(torch.int32), expected_scales.view(torch.int32))
    assert torch.equal(x, before)  # the input is left as it was


@pytest.mark.parametrize("moment", MOMENTS, ids=IDS)
def test_decoding_gives_the_codecs_values_bit_for_bit(moment, device):
    n = 40 * BLOCK + 37
    codes, scales = _encode_reference(_moment(moment, n, device), moment)
    codes[:256] = torch.arange(256, dtype=torch.uint8, device=device)  # every code once
    out, expected = torch.empty(n, device=device), torch.empty(n, device=device)
    decode_int8(codes, scales, out, moment == 0, Int8Codec(moment).shift, BLOCK)
    decode_piece("int8", codes, scales, expected, expected.view(torch.int32), moment == 0, Int8Codec(moment).shift,
                 BLOCK)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("moment", MOMENTS, ids=IDS)
def test_a_block_holding_a_nan_gets_a_nan_scale_as_amax_gives_it(moment, device):
    x = _moment(moment, 3 * BLOCK, device)
    x[BLOCK + 5] = float("nan")
    codes, scales = _encode(x, moment)
    expected_codes, expected_scales = _encode_reference(x, moment)
    assert torch.isnan(scales[1]) and not torch.isnan(scales[[0, 2]]).any()
    assert torch.equal(codes, expected_codes)


@pytest.mark.parametrize("start", [0, NOISE_PERIOD - 300], ids=["start", "near-the-tables-end"])
def test_bf16_rounding_draws_the_noise_the_cpu_pieces_draw_and_rounds_as_they_do(start, device):
    """Pieces of 256 elements: element e takes table entry ((e - e % 256 + position) % period + e % 256); a piece
    that starts near the period's end reads on past it. Non-finite values round as torch casts them."""
    codec, piece, n = Bf16Codec(1), 256, 5 * 256 + 37
    x = _moment(0, n, device)
    x[[3, 700]] = torch.tensor([float("inf"), -float("inf")], device=device)
    table = codec.noise.to(device)
    values = torch.empty(n, dtype=torch.bfloat16, device=device)
    encode_bf16(x, values, table, start, NOISE_PERIOD, piece)
    expected = torch.empty(n, dtype=torch.bfloat16, device=device)
    for a in range(0, n, piece):  # the CPU path's pieces, each from its own position in the table
        part = x[a : a + piece].clone()
        encode_piece("bf16", part, part.view(torch.int32), expected[a : a + piece], None, torch.empty(0), part,
                     part.double(), False, 0, BLOCK, table, (start + a) % NOISE_PERIOD)
    assert torch.equal(values.view(torch.int16), expected.view(torch.int16))


def test_a_nan_rounds_to_bf16s_nan(device):
    x = torch.tensor([1.0, float("nan"), -2.0], device=device)
    values = torch.empty(3, dtype=torch.bfloat16, device=device)
    encode_bf16(x, values, Bf16Codec(0).noise.to(device), 0, NOISE_PERIOD, 256)
    assert torch.isnan(values[1]) and not torch.isnan(values[[0, 2]]).any()
