"""Scaled dot-product attention run a group of key/value heads at a time: FlashAttention's sequence-long backward
buffers exist for one group at once.

Why: the flash backward keeps an fp32 accumulator of the query gradient for every query head (tokens x heads x
head_dim x 4 bytes) and, with grouped-query attention, the key and value gradients expanded to every query head
(2 x tokens x heads x head_dim in the compute dtype) before it sums them over each group. For Llama-3.2-3B at
262,144 tokens that is 3 + 3 GiB beside the gradients themselves, the largest transient of a block whose MLP
runs over sequence tiles (`tiled_mlp`). Heads do not interact: attention computed for one key/value head and its
query heads at a time, into the full outputs, is the same attention (the same kernels, the same reductions per
head), and its backward holds those buffers for one group only. The forward runs per group too, so the key and
value heads are expanded to their query heads (as the flash kernel does inside) one group at a time.

The backward reuses the forward's output and log-sum-exp (no recompute) through ATen's flash attention ops: on
CUDA `_scaled_dot_product_flash_attention` (fp16/bf16, head_dim a multiple of 8 up to 256), on the CPU its
`_for_cpu` variant (which the CPU tests use in fp32). `GroupedSDPA` is a torch function mode that sends the
`F.scaled_dot_product_attention` calls made under it here where `kv_heads_per_group` groups them and the call is
one this computes (no mask, no dropout); every other call runs as it would.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

MiB = 2**20
UNGROUPED_MIB = 1024  # attention whose flash backward buffers take at most this runs as one call
GROUP_MIB = 256  # beyond that, groups of whole key/value heads whose buffers take at most this
aten = torch.ops.aten


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """What torch's SDPA computes for q (batch, heads, tokens, head_dim) and k, v with `heads / r` heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def backward_bytes_per_head(tokens: int, head_dim: int, grouped_query: bool, itemsize: int) -> int:
    """Bytes of the flash backward's per-query-head buffers for `tokens` tokens: the fp32 query-gradient
    accumulator and, with grouped-query attention, the expanded key and value gradients."""
    return tokens * head_dim * (4 + (2 * itemsize if grouped_query else 0))


def kv_heads_per_group(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int | None:
    """Key/value heads per group for attention over `tokens` tokens (batch x sequence), or None: one call.

    One call while the flash backward's buffers (`backward_bytes_per_head` x heads) take at most UNGROUPED_MIB:
    up to there they fit beside the rest of a block (Llama-3.1-8B at 32,768 tokens: 1 GiB), and fewer kernel
    launches is all grouping would change. Beyond, as many whole key/value heads per group as keep a group's
    buffers within GROUP_MIB, at least one.
    """
    per_head = backward_bytes_per_head(tokens, head_dim, heads != kv_heads, itemsize)
    if heads % kv_heads or per_head * heads <= UNGROUPED_MIB * MiB:
        return None
    per_kv_head = per_head * (heads // kv_heads)
    group = max(1, min(kv_heads, GROUP_MIB * MiB // per_kv_head))
    return None if group >= kv_heads else group


def group_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int, group: int) -> int:
    """The transient bytes one group's backward holds: the flash buffers, its query gradient, and its key and
    value heads expanded to its query heads with their gradients."""
    q_heads = group * heads // kv_heads
    per_head = backward_bytes_per_head(tokens, head_dim, heads != kv_heads, itemsize)
    return q_heads * (per_head + tokens * head_dim * itemsize * (1 + (2 if heads != kv_heads else 0)))


def workspace_saving(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes a block's backward holds less at once with its attention grouped as `kv_heads_per_group` says: the
    flash buffers of every head, less one group's (0 where one call runs)."""
    group = kv_heads_per_group(tokens, heads, kv_heads, head_dim, itemsize)
    if group is None:
        return 0
    every_head = heads * backward_bytes_per_head(tokens, head_dim, heads != kv_heads, itemsize)
    return every_head - group_bytes(tokens, heads, kv_heads, head_dim, itemsize, group)


def applies(q: torch.Tensor) -> bool:
    """Whether ATen's flash attention ops take tensors like `q` on its device."""
    if q.device.type == "cuda":
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One flash attention call (equal head counts): output, log-sum-exp, and what the backward op needs."""
    if q.device.type == "cuda":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out, lse, ()


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, rest: tuple, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    if q.device.type == "cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = rest
        return aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q,
                                                                 max_k, 0.0, is_causal, seed, offset, scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, is_causal,
                                                                     scale=scale)


def _expanded(x: torch.Tensor, kv: slice, rep: int) -> torch.Tensor:
    """Key/value heads `kv` repeated for each of their query heads, as the group's own contiguous tensor."""
    return x[:, kv].repeat_interleave(rep, dim=1) if rep > 1 else x[:, kv].contiguous()


def _groups(kv_heads: int, group: int, rep: int) -> list[tuple[slice, slice]]:
    return [(slice(j, min(j + group, kv_heads)), slice(j * rep, min(j + group, kv_heads) * rep))
            for j in range(0, kv_heads, group)]


def _like_sdpa_output(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) laid out as (batch, tokens, heads, head_dim), as the flash kernels write
    it: the transpose Hugging Face's attention makes next is then contiguous."""
    batch, heads, tokens, _ = q.shape
    return q.new_empty(batch, tokens, heads, head_dim).transpose(1, 2)


class GroupedAttention(torch.autograd.Function):
    """Attention of q (batch, heads, tokens, head_dim) over k, v (batch, kv_heads, tokens, head_dim), a group of
    `group` key/value heads at a time, forward and backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                scale: float | None, group: int) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        out = _like_sdpa_output(q, v.shape[-1])
        flash = []
        for kv, qh in _groups(k.shape[1], group, rep):
            out_g, lse, rest = _flash_forward(q[:, qh], _expanded(k, kv, rep), _expanded(v, kv, rep), is_causal, scale)
            out[:, qh] = out_g
            flash.append((lse, rest))
        ctx.save_for_backward(q, k, v, out)
        ctx.flash, ctx.is_causal, ctx.scale, ctx.group = flash, is_causal, scale, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out = ctx.saved_tensors
        rep = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (kv, qh), (lse, rest) in zip(_groups(k.shape[1], ctx.group, rep), ctx.flash):
            dq_g, dk_g, dv_g = _flash_backward(grad[:, qh], q[:, qh], _expanded(k, kv, rep), _expanded(v, kv, rep),
                                               out[:, qh], lse, rest, ctx.is_causal, ctx.scale)
            dq[:, qh] = dq_g
            dk[:, kv] = dk_g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else dk_g
            dv[:, kv] = dv_g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else dv_g
        ctx.flash = None
        return dq, dk, dv, None, None, None


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                      scale: float | None = None, group: int = 1) -> torch.Tensor:
    """`attention_reference`, computed `group` key/value heads at a time."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return GroupedAttention.apply(q, k, v, is_causal, scale, group)


def _grouped_call(group: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
    """The call `F.scaled_dot_product_attention(...)` over groups, or None where this does not compute it."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if (attn_mask is not None or dropout_p or query.dim() != 4 or heads % kv_heads
            or (heads != kv_heads and not enable_gqa) or key.shape[2] != query.shape[2] or not applies(query)
            or not torch.is_grad_enabled() or not (query.requires_grad or key.requires_grad or value.requires_grad)):
        return None
    return grouped_attention(query, key, value, is_causal, scale, group)


class GroupedSDPA(TorchFunctionMode):
    """Under this mode, `F.scaled_dot_product_attention` calls that record a graph run over groups of `group`
    key/value heads (`grouped_attention`); any call that one does not compute runs unchanged."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _grouped_call(self.group, *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
