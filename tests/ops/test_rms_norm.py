"""RMSNorm kernel: forward and backward against Hugging Face's LlamaRMSNorm math."""
import pytest
import torch

import lightning_slide.ops.norm as norm
from lightning_slide.ops import RMSNorm, rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape, dtype, device):
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    return x, w


def _reference_fp32(x, w, eps=1e-6):
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    return xr, wr, rms_norm_reference(xr, wr, eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference_on_odd_hidden_size(dtype, device, assert_matches):
    x, w = _inputs((3, 5, 37), dtype, device)
    _, _, expected = _reference_fp32(x, w)
    y = rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    assert_matches(y, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference_for_input_and_weight(dtype, device, assert_matches):
    x, w = _inputs((3, 5, 37), dtype, device)
    xr, wr, expected = _reference_fp32(x, w)
    grad = torch.randn(expected.shape, device=device)
    rms_norm(x, w, 1e-6).backward(grad.to(dtype))
    expected.backward(grad.to(dtype).float())
    assert_matches(x.grad, xr.grad, dtype)
    assert_matches(w.grad, wr.grad, dtype)


def test_output_dtype_is_promoted_like_hf(device):
    x = torch.randn(4, 24, device=device, dtype=torch.bfloat16)
    w = torch.ones(24, device=device, dtype=torch.float32)
    assert rms_norm(x, w).dtype == rms_norm_reference(x, w).dtype == torch.float32


def test_short_rows_share_a_program_like_qwen3_head_norm(device, assert_matches):
    x, w = _inputs((5, 7, 4, 8), torch.float32, device)  # [batch, seq, heads, head_dim]
    xr, wr, expected = _reference_fp32(x, w)
    rms_norm(x, w).backward(torch.ones_like(expected))
    expected.backward(torch.ones_like(expected))
    assert_matches(x.grad, xr.grad, torch.float32)
    assert_matches(w.grad, wr.grad, torch.float32)


def test_non_contiguous_input_matches_reference(device, assert_matches):
    base = torch.randn(4, 3, 45, device=device)
    x = base[..., :33].transpose(0, 1)
    w = torch.randn(33, device=device)
    assert_matches(rms_norm(x, w), rms_norm_reference(x, w), torch.float32)


def test_weight_gradient_sums_row_blocks_across_programs(device, assert_matches, monkeypatch):
    monkeypatch.setattr(norm, "TILE", 64)  # 2 rows per block: 34 blocks, several per program
    x, w = _inputs((67, 19), torch.float32, device)
    xr, wr, expected = _reference_fp32(x, w)
    rms_norm(x, w).sum().backward()
    expected.sum().backward()
    assert_matches(x.grad, xr.grad, torch.float32)
    assert_matches(w.grad, wr.grad, torch.float32)


def test_module_is_a_drop_in_for_hf_llama_rmsnorm(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(29, eps=1e-5).to(device)
    ours = RMSNorm(29, eps=1e-5).to(device)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 7, 29, device=device)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


def test_cpu_without_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(3, 11, requires_grad=True)
    w = torch.randn(11, requires_grad=True)
    y = rms_norm(x, w)
    assert "RMSNormFunction" not in type(y.grad_fn).__name__
    torch.testing.assert_close(y, rms_norm_reference(x, w), rtol=0, atol=0)
