"""Rotary position embedding on q and k, as Hugging Face's `apply_rotary_pos_emb` does it.

HF rotates by halves: `out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`.
One program handles one token: it loads that token's cos/sin row once and rotates every q head
and every k head (GQA: k has fewer heads), so cos/sin are read once per token, not once per head.
Outputs are new tensors with the same strides as the inputs (HF's q/k are transposed views of
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


def _rope(Q, K, QO, KO, COS, SIN,
          sqb, sqs, sqh, skb, sks, skh, sqob, sqos, sqoh, skob, skos, skoh, scb, scs,
          S, HQ, HK, HALF,
          BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
          BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S
    s = tok % S
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cs = COS + b * scb + s * scs
    sn = SIN + b * scb + s * scs
    c1 = tl.load(cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sn + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sn + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qmask = (hq < HQ) & dmask[None, :]
    qin = Q + b * sqb + s * sqs + hq * sqh + d[None, :]
    qout = QO + b * sqob + s * sqos + hq * sqoh + d[None, :]
    x1 = tl.load(qin, mask=qmask, other=0.0).to(tl.float32)
    x2 = tl.load(qin + HALF, mask=qmask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(qout, y1.to(QO.dtype.element_ty), mask=qmask)
    tl.store(qout + HALF, y2.to(QO.dtype.element_ty), mask=qmask)

    hk = tl.arange(0, BLOCK_HK)[:, None]
    kmask = (hk < HK) & dmask[None, :]
    kin = K + b * skb + s * sks + hk * skh + d[None, :]
    kout = KO + b * skob + s * skos + hk * skoh + d[None, :]
    x1 = tl.load(kin, mask=kmask, other=0.0).to(tl.float32)
    x2 = tl.load(kin + HALF, mask=kmask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(kout, y1.to(KO.dtype.element_ty), mask=kmask)
    tl.store(kout + HALF, y2.to(KO.dtype.element_ty), mask=kmask)


_rope_kernel = Kernel(_rope)


def _bshd_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D q/k whose head axis is `unsqueeze_dim`."""
    if unsqueeze_dim == 1:  # [batch, heads, seq, head_dim]
        return t.stride(0), t.stride(2), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)  # [batch, seq, heads, head_dim]


def _launch(q, k, cos, sin, unsqueeze_dim: int, backward: bool):
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if cos.dim() == 2:  # [seq, head_dim] -> [1, seq, head_dim]
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    seq_axis, head_axis = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    B, S, D = q.shape[0], q.shape[seq_axis], q.shape[-1]
    hq, hk = q.shape[head_axis], k.shape[head_axis]
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_d = next_pow2(D // 2)
    block_hq, block_hk = next_pow2(hq), next_pow2(hk)
    warps = 8 if block_hq * block_d >= 2048 else 4
    _rope_kernel[(B * S,)](
        q, k, q_out, k_out, cos, sin,
        *_bshd_strides(q, unsqueeze_dim), *_bshd_strides(k, unsqueeze_dim),
        *_bshd_strides(q_out, unsqueeze_dim), *_bshd_strides(k_out, unsqueeze_dim),
        cos_b, cos.stride(1), S, hq, hk, D // 2,
        BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        **launch_options(warps))
    return q_out, k_out


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
