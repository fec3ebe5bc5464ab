"""Rotary position embedding on q and k, as Hugging Face's `apply_rotary_pos_emb` does it.

HF rotates by halves: `out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`.
One launch rotates q and k together (as Liger does): each program takes a block of positions of
one sequence and all of their q heads and k heads (GQA gives k fewer), so each token's cos/sin row
is read once and shared by every head of both tensors. The backward is the same kernel with the transposed rotation.
Math in fp32, one rounding to the output dtype; any (batch, seq, head) strides, unit stride on the
head dim, so HF's transposed views go in and come out without a copy.

Out of place, as HF's function is: writing into q and k would need `ctx.mark_dirty`, and because
HF's q/k are views, autograd would then wrap the backward in CopySlices, which copies the whole
gradient twice more; writing in place without telling autograd (Liger's way) corrupts any other
user of q or k, and in the backward any other user of the incoming gradient. The bytes moved are
the same either way: read q and k, write their rotations. cos and sin get no gradient: HF computes
them from a buffer, not a parameter.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._triton import Kernel, device_function, launch_options, next_pow2, use_triton

TILE = 2048  # q elements (tokens x heads x half head dim) per program: one token of Llama-3-8B


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's `apply_rotary_pos_emb` (Llama/Qwen2/Qwen3/Mistral), verbatim."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@device_function
def _rotate_heads(X, Y, x_tok, y_tok, x_h, y_h, tok_ok, d, c1, c2, s1, s2, H, HALF,
                  BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate all H heads of a block of tokens: a [tokens, heads, half head dim] tile per half."""
    h = tl.arange(0, BLOCK_H)[None, :, None]
    mask = tok_ok[:, None, None] & (h < H) & (d < HALF)
    xp = X + x_tok[:, None, None] + h * x_h + d
    yp = Y + y_tok[:, None, None] + h * y_h + d
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



def _rope(Q, K, QO, KO, COS, SIN, q_b, q_s, q_h, k_b, k_s, k_h, qo_b, qo_s, qo_h, ko_b, ko_s, ko_h,
          cos_b, cos_s, S, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
          BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
          BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_T positions of one sequence: cos/sin loaded once, then every q and k head.

    The grid is (position blocks, batch), so no program divides a token index (an int64 division
    costs dozens of instructions, which an elementwise kernel cannot hide).
    """
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = s < S
    d = tl.arange(0, BLOCK_D)[None, None, :]
    cmask = tok_ok[:, None, None] & (d < HALF)
    cp = (b * cos_b + s * cos_s)[:, None, None] + d
    c1 = tl.load(COS + cp, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cp + HALF, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cp, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cp + HALF, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(Q, QO, b * q_b + s * q_s, b * qo_b + s * qo_s, q_h, qo_h, tok_ok, d,
                  c1, c2, s1, s2, HQ, HALF, BACKWARD, BLOCK_HQ)
    _rotate_heads(K, KO, b * k_b + s * k_s, b * ko_b + s * ko_s, k_h, ko_h, tok_ok, d,
                  c1, c2, s1, s2, HK, HALF, BACKWARD, BLOCK_HK)


_rope_kernel = Kernel(_rope)


def _bsh(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D q/k whose head axis is `unsqueeze_dim`."""
    b, x, y, _ = t.stride()
    return (b, y, x) if unsqueeze_dim == 1 else (b, x, y)  # [b, heads, seq, d] or [b, seq, heads, d]


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, unsqueeze_dim: int, backward: bool, dtypes) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over all tokens of q and k; outputs of `dtypes`, with their inputs' strides."""
    q, k = _unit_stride(q), _unit_stride(k)
    qo, ko = torch.empty_like(q, dtype=dtypes[0]), torch.empty_like(k, dtype=dtypes[1])
    seq_axis, head_axis = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    S, hq, hk, half = q.shape[seq_axis], q.shape[head_axis], k.shape[head_axis], q.shape[-1] // 2
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_hq, block_d = next_pow2(hq), next_pow2(half)
    block_t = max(1, min(next_pow2(S), TILE // (block_hq * block_d)))
    _rope_kernel[(-(-S // block_t), q.shape[0])](
        q, k, qo, ko, cos, sin, *_bsh(q, unsqueeze_dim), *_bsh(k, unsqueeze_dim),
        *_bsh(qo, unsqueeze_dim), *_bsh(ko, unsqueeze_dim), cos_b, cos.stride(1), S,
        HQ=hq, HK=hk, HALF=half, BACKWARD=backward, BLOCK_T=block_t, BLOCK_HQ=block_hq,
        BLOCK_HK=next_pow2(hk), BLOCK_D=block_d,
        **launch_options(4 if block_t * block_hq * block_d <= TILE else 8))
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    """Triton RoPE for q and k together; saves only cos and sin.

    Outputs have HF's dtype, the promotion of q's (k's) and cos's: under autocast HF's cos/sin
    follow the fp32 hidden states while q and k come out of the projections in bf16.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.dtypes = unsqueeze_dim, (q.dtype, k.dtype)
        dtypes = (torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype))
        return _launch(q, k, cos, sin, unsqueeze_dim, False, dtypes)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = _launch(dq, dk, cos, sin, ctx.unsqueeze_dim, True, ctx.dtypes)
        return dq_in, dk_in, None, None, None


def _kernel_applies(q, k, cos, sin, unsqueeze_dim: int) -> bool:
    """HF's 4-D layouts with cos/sin [batch or 1, seq, head_dim] over the full (even) head dim."""
    if not (use_triton(q) and unsqueeze_dim in (1, 2) and q.dim() == k.dim() == 4 and cos.dim() == 3):
        return False
    seq = 3 - unsqueeze_dim
    return (q.shape[-1] % 2 == 0 and q.shape[-1] == k.shape[-1] == cos.shape[-1]
            and q.shape[0] == k.shape[0] and q.shape[seq] == k.shape[seq] == cos.shape[-2]
            and cos.shape[0] in (1, q.shape[0])
            and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.dtype == sin.dtype and q.is_floating_point() and k.is_floating_point()
            and not (cos.requires_grad or sin.requires_grad))


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as HF's; Triton when it applies, else the reference."""
    if _kernel_applies(q, k, cos, sin, unsqueeze_dim):
        return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)
    return rope_reference(q, k, cos, sin, unsqueeze_dim)
