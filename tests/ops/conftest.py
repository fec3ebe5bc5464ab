"""Kernel tests run on the GPU when there is one, else in Triton's CPU interpreter.

The variable must be set before anything defines a Triton kernel; `ops` itself decides at launch
time (see ops/_triton.py), so the order in which test modules import things does not matter.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Close within the dtype's tolerance, relative to the element and to the tensor's scale.

    The scale term keeps near-zero elements of a gradient from failing on absolute noise; NaN and
    infinity never pass.
    """
    assert torch.isfinite(actual).all(), "non-finite values"
    tol = TOLERANCE[dtype]
    expected = expected.float()
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol * max(scale, 1e-6))


@pytest.fixture
def assert_matches():
    return _assert_matches


def _losses_unpatched_and_patched(model, ids, labels, steps: int, lr: float):
    """Train a copy of `model` as is, then `model` under ops.patch; return both loss curves."""
    import copy

    from lightning_slide import ops

    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    expected = train(copy.deepcopy(model))  # first: the patch replaces HF's RoPE module-wide
    with ops.patch(model):
        return expected, train(model)


@pytest.fixture
def train_both():
    return _losses_unpatched_and_patched


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Fixed seed; one intra-op thread, since at these tiny shapes extra threads only contend
    (a 5x16 matmul took 20 ms with two threads on a busy two-core runner, 5 us with one)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
