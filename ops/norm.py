"""RMSNorm, `y = w * (x / rms(x))`, with the exact casting of Hugging Face's Llama/Qwen/Mistral norm.

HF computes the statistics in fp32, rounds the normalised activations back to the input dtype,
and only then multiplies by the weight (so the output dtype is the promotion of input and weight
dtypes). We do the same in one pass over the row, and the backward reads `x` once more and writes
`dx` plus per-program partial sums of `dw` (fp32), summed at the end: one kernel per direction.
"""
from __future__ import annotations

import torch
import triton.language as tl
from torch import nn

from ops._triton import Kernel, launch_options, next_pow2, sm_count, use_triton

MAX_HIDDEN = 65536  # one row must fit in one program's registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, verbatim: the behaviour the kernel must match."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # HF rounds here, before the weight
    tl.store(Y + row * stride_y + cols, (n * w).to(Y.dtype.element_ty), mask=mask)


def _bwd(DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    base = start.to(tl.int64)
    x_ptr, dy_ptr, dx_ptr, rstd_ptr = X + base * stride_x, DY + base * stride_dy, DX + base * stride_dx, RSTD + base
    for _ in range(start, end):
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr)
        xhat = x * rstd
        dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        dn = dy * w
        dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=0) / N))
        tl.store(dx_ptr + cols, dx.to(DX.dtype.element_ty), mask=mask)
        x_ptr += stride_x
        dy_ptr += stride_dy
        dx_ptr += stride_dx
        rstd_ptr += 1
    tl.store(DW + pid * N + cols, dw, mask=mask)


_fwd_kernel = Kernel(_fwd)
_bwd_kernel = Kernel(_bwd)


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View as [rows, hidden] with a unit stride on the hidden dim (copy only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; saves x and the fp32 1/rms per row (4 bytes per token)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _rows(x)
        M, N = x2.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        block = next_pow2(N)
        _fwd_kernel[(M,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), N, eps, BLOCK=block,
                          **launch_options(_warps(block)))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        programs = max(1, min(M, sm_count(x2.device)))
        rows_per_program = -(-M // programs)
        dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x2.device)
        block = next_pow2(N)
        _bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0),
                                 dx.stride(0), M, N, rows_per_program, BLOCK=block,
                                 **launch_options(_warps(block)))
        dw = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: Triton on CUDA (or under the interpreter), else the reference."""
    if use_triton(x) and x.shape[-1] <= MAX_HIDDEN:
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    """Drop-in for LlamaRMSNorm (same `weight` and `variance_epsilon` attributes)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
