"""The master's planes: the torch ops give back every non-NaN fp32 exactly, and the kernels give the torch ops' bits."""
import pytest
import torch

from lightning_slide import master_halves as reference
from lightning_slide.ops import master_halves as kernels


def _masters(n: int, device: str) -> torch.Tensor:
    """Random bits (every sign, exponent and NaN), low halves exactly at a tie with odd and even high halves, just
    below and above one, subnormals, zeros, infinities and the largest finite values (which round to infinity)."""
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    bits[0::7] = (bits[0::7] & ~0xFFFF) | 0x8000
    bits[1::7] = (bits[1::7] & ~0xFFFF) | 0x7FFF
    bits[2::7] = (bits[2::7] & ~0xFFFF) | 0x8001
    bits[3::7] &= 0x807FFFFF  # subnormals of either sign
    special = torch.tensor([0, -(2**31), 0x7F800000, -8388608, 0x7F7FFFFF, -8388609, 0x7F7F8000, 1, 0x8000],
                           dtype=torch.int32)
    bits[: min(n, special.numel())] = special[:n]
    return bits.view(torch.float32).to(device)


def _planes(n: int, device: str, fill: int = 0xA5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.int16, device=device),
            torch.full((reference.parity_bytes(n),), fill, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("n", [8, 4096 * 3, 4096 * 2 + 13, 5], ids=["one-byte", "whole-blocks", "partial", "short"])
def test_the_planes_join_to_every_non_nan_master_exactly_and_hold_its_nearest_even_bf16(n, device):
    master = _masters(n, device)
    weights, low, parity = _planes(n, device)
    reference.split(master, weights, low, parity)
    assert torch.equal(weights.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    joined = reference.join(weights, low, parity, torch.empty_like(master))
    nan = torch.isnan(master)
    assert torch.equal(joined.view(torch.int32)[~nan], master.view(torch.int32)[~nan])
    assert torch.isnan(joined[nan]).all()


@pytest.mark.parametrize("n", [8, 4096 * 3, 4096 * 2 + 13, 5], ids=["one-byte", "whole-blocks", "partial", "short"])
def test_the_kernels_split_and_join_as_the_torch_ops_do_keeping_a_partial_bytes_other_bits(n, device):
    master = _masters(n, device)
    expected, actual = _planes(n, device), _planes(n, device)
    reference.split(master, *expected)
    kernels.split(master, *actual)
    finite = ~torch.isnan(master)
    assert torch.equal(actual[0].view(torch.int16)[finite], expected[0].view(torch.int16)[finite])
    assert torch.isnan(actual[0][~finite].float()).all()
    assert torch.equal(actual[1], expected[1]) and torch.equal(actual[2], expected[2])
    if n % 8:
        assert actual[2][-1].item() >> (n % 8) == 0xA5 >> (n % 8)  # the bits past n, as they were
    joined = kernels.join(*expected, torch.empty_like(master))
    assert torch.equal(joined.view(torch.int32), reference.join(*expected, torch.empty_like(master)).view(torch.int32))



def _planes_24(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.int8, device=device),
            torch.full((reference.parity_bytes(n),), 0xA5, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("n", [4096 * 2 + 13, 5], ids=["partial", "short"])
def test_24_bit_planes_join_to_the_master_rounded_down_or_up_at_bit_8_and_hold_its_bf16(n, device):
    master = _masters(n, device)
    weights, low, parity = _planes_24(n, device)
    reference.split(master, weights, low, parity, seed=12345, first=77)
    joined = reference.join(weights, low, parity, torch.empty_like(master))
    finite = torch.isfinite(master)
    step = joined.view(torch.int32)[finite].long() - (master.view(torch.int32)[finite] & -256).long()
    assert set(step.unique().tolist()) <= {0, 256} and (joined.view(torch.int32)[finite] & 0xFF == 0).all()
    assert torch.equal(weights.view(torch.int16), joined.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(joined[torch.isinf(master)], master[torch.isinf(master)])


def test_24_bit_rounding_is_unbiased_over_the_elements_of_a_unit():
    """Each element draws its own noise (its index in the unit, the step and the unit hashed): over 65,536 copies
    of one value whose low byte is 0x40, a quarter round up."""
    bits = torch.full((1 << 16,), 0x3F812340, dtype=torch.int32)
    weights, low, parity = _planes_24(bits.numel(), "cpu")
    reference.split(bits.view(torch.float32), weights, low, parity, seed=reference.seed(3, 5), first=1 << 20)
    up = (reference.join(weights, low, parity, torch.empty(bits.numel())).view(torch.int32) != 0x3F812300)
    assert abs(up.float().mean().item() - 0.25) < 0.01


@pytest.mark.parametrize("n", [4096 * 3, 4096 * 2 + 13, 5], ids=["whole-blocks", "partial", "short"])
def test_the_kernels_split_and_join_24_bit_planes_as_the_torch_ops_do(n, device):
    master = _masters(n, device)
    expected, actual = _planes_24(n, device), _planes_24(n, device)
    reference.split(master, *expected, seed=987654321, first=4096)
    kernels.split(master, *actual, seed=987654321, first=4096)
    finite = ~torch.isnan(master)
    assert torch.equal(actual[0].view(torch.int16)[finite], expected[0].view(torch.int16)[finite])
    assert torch.equal(actual[1][finite], expected[1][finite]) and torch.equal(actual[2], expected[2])
    joined = kernels.join(*expected, torch.empty_like(master))
    assert torch.equal(joined.view(torch.int32), reference.join(*expected, torch.empty_like(master)).view(torch.int32))
