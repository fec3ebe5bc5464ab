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

