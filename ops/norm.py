"""RMSNorm, `y = w * (x / rms(x))`, with the exact casting of Hugging Face's Llama/Qwen/Mistral norm.

HF computes the statistics in fp32, rounds the normalised activations back to the input dtype,
and only then multiplies by the weight (so the output dtype is the promotion of input and weight
dtypes). We do the same in one pass over each row; the backward reads `x` and `dy` once and writes
`dx` plus per-program partial sums of `dw` (fp32), summed at the end: one kernel per direction.
Short rows (Qwen3 normalises each 128-wide head) are packed several to a program.
"""
from __future__ import annotations

import torch
import triton.language as tl
from torch import nn

from ._triton import Kernel, launch_options, next_pow2, sm_count, use_triton

MAX_HIDDEN = 65536  # one row must fit in one program's registers
BWD_PROGRAMS_PER_SM = 2  # backward programs per SM: enough loads in flight, few dw partials


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, verbatim: the behaviour the kernel must match."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _fwd(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    n = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # HF rounds here, before the weight
    y = n * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _bwd(DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, M, N, programs,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each program walks row blocks pid, pid + programs, ...; dw is summed in registers."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_M), programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        xhat = x * rstd
        dw += tl.sum(dy * xhat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=1) / N)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * N + cols, dw, mask=col_mask)


_fwd_kernel = Kernel(_fwd)
_bwd_kernel = Kernel(_bwd)


TILE = 4096  # elements per program step: several short rows (Qwen3's per-head q/k norm) or one long


def _tiles(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an M x N problem."""
    block_n = next_pow2(N)
    block_m = max(1, min(next_pow2(M), TILE // block_n))
    size = block_m * block_n
    return block_m, block_n, 16 if size >= 8192 else 8 if size >= 2048 else 4


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
        block_m, block_n, warps = _tiles(M, N)
        _fwd_kernel[(-(-M // block_m),)](x2, weight, y, rstd, x2.stride(0), y.stride(0), M, N, eps,
                                         BLOCK_M=block_m, BLOCK_N=block_n, **launch_options(warps))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        block_m, block_n, warps = _tiles(M, N)
        programs = max(1, min(-(-M // block_m), BWD_PROGRAMS_PER_SM * sm_count(x2.device)))
        dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x2.device)
        _bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0),
                                 dx.stride(0), M, N, programs, BLOCK_M=block_m, BLOCK_N=block_n,
                                 **launch_options(warps))
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
