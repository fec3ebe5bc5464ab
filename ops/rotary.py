"""Rotary position embedding on q and k, as Hugging Face's `apply_rotary_pos_emb` does it.

HF rotates by halves: `out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`.
One launch per tensor (q, then k: GQA gives k fewer heads); each program rotates a tile of
(batch, seq, head) rows in fp32, reading the matching cos/sin rows (repeats hit the cache). Outputs are new tensors with the same strides as the inputs (HF's q/k are transposed views of
[batch, seq, heads, head_dim] memory, and so are ours). cos and sin get no gradient: HF computes
them from a buffer, not a parameter.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ops._triton import Kernel, launch_options, next_pow2, use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's `apply_rotary_pos_emb` (Llama/Qwen2/Qwen3/Mistral), verbatim."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope(X, Y, COS, SIN, sxb, sxs, sxh, syb, sys, syh, scb, scs, S, H, R, HALF,
          BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate BLOCK_R rows of one tensor; row r is (batch, seq, head) with the head fastest."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = r % H
    tok = r // H
    b = tok // S
    s = tok % S
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (r < R)[:, None] & (d < HALF)
    cs = (b * scb + s * scs)[:, None] + d
    c1 = tl.load(COS + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    xp = X + (b * sxb + s * sxs + h * sxh)[:, None] + d
    yp = Y + (b * syb + s * sys + h * syh)[:, None] + d
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(yp, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=mask)


_rope_kernel = Kernel(_rope)
TILE = 4096  # elements (rows x half head dim) per program


def _bsh_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D q/k whose head axis is `unsqueeze_dim`."""
    if unsqueeze_dim == 1:  # [batch, heads, seq, head_dim]
        return t.stride(0), t.stride(2), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)  # [batch, seq, heads, head_dim]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
            backward: bool) -> torch.Tensor:
    """One launch over all (batch, seq, head) rows of x; the output keeps x's strides."""
    y = torch.empty_like(x)
    seq_axis, head_axis = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    B, S, H, D = x.shape[0], x.shape[seq_axis], x.shape[head_axis], x.shape[-1]
    rows = B * S * H
    block_d = next_pow2(D // 2)
    block_r = max(1, min(next_pow2(rows), TILE // block_d))
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rope_kernel[(-(-rows // block_r),)](
        x, y, cos, sin, *_bsh_strides(x, unsqueeze_dim), *_bsh_strides(y, unsqueeze_dim),
        cos_b, cos.stride(1), S, H, rows, D // 2,
        BACKWARD=backward, BLOCK_R=block_r, BLOCK_D=block_d, **launch_options(8))
    return y


def _launch(q, k, cos, sin, unsqueeze_dim: int, backward: bool):
    if cos.dim() == 2:  # [seq, head_dim] -> [1, seq, head_dim]
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return (_rotate(q, cos, sin, unsqueeze_dim, backward),
            _rotate(k, cos, sin, unsqueeze_dim, backward))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class RoPEFunction(torch.autograd.Function):
    """Triton RoPE for q and k together; saves only cos and sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int):
        q, k, cos, sin = map(_unit_stride, (q, k, cos, sin))
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return _launch(q, k, cos, sin, unsqueeze_dim, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _unit_stride(dq), _unit_stride(dk)
        dq_in, dk_in = _launch(dq, dk, cos, sin, ctx.unsqueeze_dim, backward=True)
        return dq_in, dk_in, None, None, None


def _kernel_applies(q, k, cos, unsqueeze_dim: int) -> bool:
    """The kernel covers HF's 4-D layouts with cos/sin over the full (even) head dim."""
    return (use_triton(q) and q.dim() == 4 and k.dim() == 4 and unsqueeze_dim in (1, 2)
            and q.shape[-1] % 2 == 0 and cos.shape[-1] == q.shape[-1] == k.shape[-1]
            and cos.dim() in (2, 3) and not cos.requires_grad)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as HF's; Triton when it applies, else the reference."""
    if _kernel_applies(q, k, cos, unsqueeze_dim):
        return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)
    return rope_reference(q, k, cos, sin, unsqueeze_dim)
