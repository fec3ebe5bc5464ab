"""Host buffers that may be page-locked own whole pages, so that locking one never overlaps another's lock."""

import pytest
import torch

from lightning_slide.pinned import PAGE, host_empty, host_zeros


@pytest.mark.parametrize("numel", [1, 1000, PAGE // 4, PAGE // 4 + 1, 3 * PAGE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_host_buffer_starts_on_a_page_and_owns_every_page_it_touches(numel, dtype):
    buffer = host_empty(numel, dtype)
    storage = buffer.untyped_storage()
    end = buffer.data_ptr() + numel * dtype.itemsize
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.is_contiguous()
    assert buffer.data_ptr() % PAGE == 0
    assert storage.data_ptr() <= buffer.data_ptr() and -(-end // PAGE) * PAGE <= storage.data_ptr() + storage.nbytes()


def test_host_zeros_are_zero():
    assert not host_zeros(12345, torch.bfloat16).any()
