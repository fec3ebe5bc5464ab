"""Host buffers that may be page-locked own whole pages, so that locking one never overlaps another's lock."""

import pytest
import torch

from lightning_slide.pinned import PAGE, host_empty, host_zeros


@pytest.mark.parametrize("numel", [1, 1000, PAGE // 4, PAGE // 4 + 1, 3 * PAGE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_host_buffer_and_its_storage_start_on_a_page_and_own_every_page_they_touch(numel, dtype):
    buffer = host_empty(numel, dtype)
    storage = buffer.untyped_storage()
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.is_contiguous()
    assert storage.data_ptr() == buffer.data_ptr() and buffer.data_ptr() % PAGE == 0
    assert storage.nbytes() == -(-numel * dtype.itemsize // PAGE) * PAGE


def test_an_empty_host_buffer_is_an_empty_tensor():
    assert host_empty(0, torch.bfloat16).shape == (0,)


def test_host_zeros_are_zero():
    assert not host_zeros(12345, torch.bfloat16).any()
