"""Fused linear cross-entropy: `mean CE(hidden @ W.T (+ b), targets)` without the full logits.

A causal LM's loss head multiplies every token's hidden state by a vocabulary-sized matrix; for
16k tokens and a 128k vocabulary the fp32 logits alone are 8 GiB. We walk the tokens in chunks
sized to a memory budget (default 63 MiB of logits: 256 rows at vocab 128256). For each chunk:

1. logits = x_c @ W.T into one reused buffer (cuBLAS, input dtype, fp32 accumulation);
2. one Triton program per row computes the log-sum-exp online over vocabulary blocks, writes the
   row's loss, and overwrites the logits in place with d(loss)/d(logits);
3. grad_x[c] = dlogits @ W (a full-vocab reduction, written once) and grad_W += dlogits.T @ x_c.

So the gradients are finished during the forward (6·T·H·V FLOPs in all, as Liger does, against
8·T·H·V for recomputing designs such as Cut Cross-Entropy); backward only scales them by the
incoming gradient. grad_W accumulates in the weight's dtype (bf16 for a bf16 head, like Liger's
default): each chunk's product is summed in fp32 inside cuBLAS, then rounded once into grad_W, so
a 16k-token bf16 head takes 64 roundings of its running sum.

Why the chunk's two gradient GEMMs overlap (`overlap=True`, on CUDA): with 256-row chunks the
grad_W update is memory-bound (it reads and writes all of grad_W, 2 GB at vocab 128256, for
0.27 TFLOP of work), while grad_x = dlogits @ W has only 256 x 4096 outputs, about 64 output tiles
for 132 SMs unless cuBLAS splits its 128k-long reduction (the 1.7 ms per chunk measured on one
stream fits half the SMs idling through it). Both only read the chunk's dlogits, so grad_x runs
on a second, high-priority stream, queued first so its blocks are placed first, and the grad_W
update takes the SMs it leaves; the next chunk's logits wait for both. The second stream costs
cuBLAS one more workspace (kept per stream from first use, so not part of each call's memory).
Within the budget the alternatives cost more: larger chunks through recomputing the logits in
vocabulary slices add a share (P-1)/P of a fourth GEMM for P-times-larger chunks.

Options: logit softcapping `c·tanh(z/c)`, a z-loss `w·lse²`, Hugging Face's `num_items_in_batch`
normaliser, and a bias. With every label ignored the loss is 0, not NaN.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton.language as tl
from torch import nn

from ops._triton import Kernel, device_function, launch_options, next_pow2, use_triton

IGNORE_INDEX = -100
CHUNK_MIB = 63.0  # logits buffer budget: keeps the transient memory under 64 MiB
CE_BLOCK = 8192  # vocabulary columns per step of the row kernel's online log-sum-exp
OVERLAP = True  # default: grad_x beside the grad_W update on a second CUDA stream


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   bias: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                                   softcap: float | None = None, z_loss_weight: float = 0.0,
                                   num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch, with the full logits: HF's `lm_head` then `ForCausalLMLoss` (upcast to fp32).

    `targets` are already aligned with `hidden` (shifted, for a causal LM).
    """
    logits = F.linear(hidden, weight, bias).float().reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    targets = targets.reshape(-1)
    valid = targets != ignore_index
    ce = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    if z_loss_weight:
        ce = ce + z_loss_weight * torch.logsumexp(logits, dim=-1).pow(2) * valid
    return ce.sum() / _normaliser(valid, num_items_in_batch)


def _normaliser(valid: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """The divisor of the summed loss, as a device tensor (no host sync); never below 1."""
    if num_items_in_batch is None:
        n = valid.sum()
    else:
        n = torch.as_tensor(num_items_in_batch, device=valid.device)
    return n.to(torch.float32).clamp(min=1.0)


@device_function
def _logits(P, c, V, softcap, HAS_SOFTCAP: tl.constexpr):
    """The logits at columns `c` in fp32 (softcapped, `softcap·tanh(z/softcap)`, when asked); -inf past V."""
    mask = c < V
    z = tl.load(P + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return tl.where(mask, z, float("-inf"))


def _ce_rows(L, stride_l, Y, LOSS, INV, V, ignore_index, softcap, z_w,
             HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row: its log-sum-exp, its loss, then dlogits written over the logits.

    The log-sum-exp runs online per lane (a running max and sum for each of the BLOCK columns
    a step loads), so the loop over the vocabulary has no cross-warp reduction between its loads;
    the lanes are combined once at the end.
    """
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    y = tl.load(Y + row)
    valid = y != ignore_index
    cols = tl.arange(0, BLOCK)

    m = _logits(base, cols, V, softcap, HAS_SOFTCAP)  # full unless V < BLOCK: no -inf in later steps' m
    s = tl.where(cols < V, 1.0, 0.0)
    for off in range(BLOCK, V, BLOCK):
        z = _logits(base, off + cols, V, softcap, HAS_SOFTCAP)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))

    zy = _logits(base, tl.where(valid, y, 0), V, softcap, HAS_SOFTCAP)
    scale = tl.where(valid, tl.load(INV), 0.0)
    tl.store(LOSS + row, (lse - zy + z_w * lse * lse) * scale)

    if WRITE_GRAD:  # d/dz [lse - z_y + w·lse²] = p·(1 + 2w·lse) - onehot(y), times the softcap's slope
        coef = 1.0 + 2.0 * z_w * lse
        for off in range(0, V, BLOCK):
            c = off + cols
            mask = c < V
            z = _logits(base, c, V, softcap, HAS_SOFTCAP)
            g = (tl.exp(z - lse) * coef - tl.where(c == y, 1.0, 0.0)) * scale
            if HAS_SOFTCAP:
                t = tl.where(mask, z / softcap, 0.0)  # tanh of the raw logit
                g = g * (1.0 - t * t)
            tl.store(base + c, g.to(L.dtype.element_ty), mask=mask)


def _scale(X, S, n, BLOCK: tl.constexpr):
    """x *= s, with s an fp32 device scalar (a bf16 `mul_` would round s first)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * tl.load(S).to(tl.float32)).to(X.dtype.element_ty), mask=mask)


_ce_rows_kernel = Kernel(_ce_rows)
_scale_kernel = Kernel(_scale)


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    softcap: float | None
    z_loss_weight: float
    chunk_mib: float
    overlap: bool
    need_grad_x: bool
    need_grad_w: bool
    need_grad_b: bool

    @property
    def write_grad(self) -> bool:
        return self.need_grad_x or self.need_grad_w or self.need_grad_b


def _rows_triton(logits, targets, loss, inv, o: _Options) -> None:
    block = min(next_pow2(logits.shape[1]), CE_BLOCK)
    _ce_rows_kernel[(logits.shape[0],)](
        logits, logits.stride(0), targets, loss, inv, logits.shape[1], o.ignore_index,
        float(o.softcap or 1.0), float(o.z_loss_weight), HAS_SOFTCAP=o.softcap is not None,
        WRITE_GRAD=o.write_grad, BLOCK=block, **launch_options(16))


def _rows_torch(logits, targets, loss, inv, o: _Options) -> None:
    """The row kernel in PyTorch (CPU without the interpreter): same outputs, same in-place write."""
    z = logits.float()
    if o.softcap is not None:
        t = torch.tanh(z / o.softcap)
        z = o.softcap * t
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != o.ignore_index
    y = torch.where(valid, targets, 0).unsqueeze(1)
    scale = torch.where(valid, inv, 0.0)
    loss.copy_((lse - z.gather(1, y).squeeze(1) + o.z_loss_weight * lse * lse) * scale)
    if o.write_grad:
        g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * o.z_loss_weight * lse)[:, None]
        g.scatter_add_(1, y, -torch.ones_like(y, dtype=g.dtype))
        g *= scale[:, None]
        if o.softcap is not None:
            g *= 1.0 - t * t
        logits.copy_(g)


def chunk_rows(tokens: int, vocab: int, element_size: int, chunk_mib: float = CHUNK_MIB) -> int:
    """Tokens per chunk so that one chunk's logits fit the budget (a multiple of 8 when large)."""
    rows = max(1, int(chunk_mib * 2**20) // (vocab * element_size))
    if rows >= tokens:
        return max(tokens, 1)
    return rows // 8 * 8 if rows >= 64 else rows


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(x: torch.Tensor, o: _Options, grad_x, grad_w) -> torch.cuda.Stream | None:
    """The second stream for grad_x, when there is both a grad_x and a grad_W GEMM to overlap."""
    if not (o.overlap and x.is_cuda and grad_x is not None and grad_w is not None):
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


@contextmanager
def _beside(side: torch.cuda.Stream | None, main: torch.cuda.Stream | None):
    """Run the block on `side` after all work queued so far on `main` (in place when no side)."""
    if side is None:
        yield
        return
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield


def _loss_and_grads(x, w, b, y, inv, o: _Options):
    """The chunk loop: returns the loss and the finished (unscaled) gradients."""
    T, V = x.shape[0], w.shape[0]
    rows_fn = _rows_triton if use_triton(x) else _rows_torch
    loss_rows = torch.zeros(T, dtype=torch.float32, device=x.device)
    gx = torch.empty_like(x) if o.need_grad_x else None
    gw = (torch.empty_like(w) if T else torch.zeros_like(w)) if o.need_grad_w else None
    gb = torch.zeros(V, dtype=torch.float32, device=x.device) if o.need_grad_b else None
    rows = chunk_rows(T, V, x.element_size(), o.chunk_mib)
    buf = torch.empty((rows, V), dtype=x.dtype, device=x.device)
    side = _side_stream(x, o, gx, gw)
    main = torch.cuda.current_stream(x.device) if side is not None else None
    for s in range(0, T, rows):
        e = min(s + rows, T)
        xc, lc = x[s:e], buf[: e - s]
        if side is not None:  # the buffer is free once the previous chunk's grad_x has read it
            main.wait_stream(side)
        if b is None:
            torch.mm(xc, w.t(), out=lc)
        else:
            torch.addmm(b, xc, w.t(), out=lc)
        rows_fn(lc, y[s:e], loss_rows[s:e], inv, o)
        if gx is not None:
            with _beside(side, main):
                torch.mm(lc, w, out=gx[s:e])
        if gw is not None:
            if s == 0:
                torch.mm(lc.t(), xc, out=gw)
            else:
                gw.addmm_(lc.t(), xc)
        if gb is not None:
            gb += lc.sum(0, dtype=torch.float32)
    if side is not None:  # grad_x is complete, and `buf` may be reused, only after this
        main.wait_stream(side)
    return loss_rows.sum(), gx, gw, (gb.to(b.dtype) if gb is not None else None)


def _scale_(t: torch.Tensor, s: torch.Tensor) -> None:
    """In-place `t *= s` in fp32 math; s is a 0-dim tensor that stays on the device."""
    if use_triton(t) and t.is_contiguous():
        block = 4096
        _scale_kernel[(-(-t.numel() // block),)](t, s.float(), t.numel(), BLOCK=block,
                                                  **launch_options(8))
    else:
        t.copy_(t.float() * s.float())


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Loss in forward with gradients computed alongside; backward scales them (once)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, inv_norm, options: _Options):
        with torch.autocast(x.device.type, enabled=False):
            loss, gx, gw, gb = _loss_and_grads(x, weight, bias, targets, inv_norm, options)
        ctx.grads = (gx, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward can run only once per forward")
        grads, ctx.grads = ctx.grads, None
        for g in grads:
            if g is not None:
                _scale_(g, grad_loss)
        return (*grads, None, None, None)


def _autocast(x, w, b):
    """Inside autocast, compute where nn.Linear would: in the autocast dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        x, w = x.to(dtype), w.to(dtype)
        b = b.to(dtype) if b is not None else None
    elif x.dtype != w.dtype:
        dtype = torch.promote_types(x.dtype, w.dtype)
        x, w = x.to(dtype), w.to(dtype)
        b = b.to(dtype) if b is not None else None
    return x, w, b


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                         softcap: float | None = None, z_loss_weight: float = 0.0,
                         num_items_in_batch: int | torch.Tensor | None = None,
                         chunk_mib: float = CHUNK_MIB, overlap: bool | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T (+ bias)` against `targets` (already aligned).

    The mean is over non-ignored targets, or the sum divided by `num_items_in_batch` when given
    (HF's convention under gradient accumulation). Returns an fp32 scalar. `chunk_mib` bounds the
    logits buffer; `overlap` (default `OVERLAP`) runs grad_x beside the grad_W update on CUDA.
    """
    x, w, b = _autocast(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    y = targets.reshape(-1).to(device=x.device, dtype=torch.long)
    grad = torch.is_grad_enabled()
    o = _Options(ignore_index, softcap, float(z_loss_weight), chunk_mib, OVERLAP if overlap is None else overlap,
                 need_grad_x=grad and x.requires_grad, need_grad_w=grad and w.requires_grad,
                 need_grad_b=grad and b is not None and b.requires_grad)
    inv = 1.0 / _normaliser(y != ignore_index, num_items_in_batch)
    loss = LinearCrossEntropyFunction.apply(x, w, b, y, inv, o)
    return loss


def causal_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's causal shift: position t predicts token t+1; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                   bias: torch.Tensor | None = None, *, shift_labels: torch.Tensor | None = None,
                   ignore_index: int = IGNORE_INDEX, **kwargs) -> torch.Tensor:
    """HF's `ForCausalLMLoss` on `lm_head(hidden)`, fused: shifts `labels` unless shifted ones are given."""
    targets = shift_labels if shift_labels is not None else causal_targets(labels, ignore_index)
    return linear_cross_entropy(hidden, weight, targets, bias, ignore_index=ignore_index, **kwargs)


class LinearCrossEntropyHead(nn.Linear):
    """An `nn.Linear` lm_head that returns the causal-LM loss instead of logits when given labels.

    `ops.patch` swaps a model's `lm_head` to this class in place (same `weight` Parameter, so tied
    embeddings stay tied), so the head's weight is read inside the head's own forward call.
    """

    softcap: float | None = None
    z_loss_weight: float = 0.0
    chunk_mib: float = CHUNK_MIB

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, *,
                shift_labels: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        if labels is None and shift_labels is None:
            logits = F.linear(hidden, self.weight, self.bias)
            return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)
        return causal_lm_loss(hidden, self.weight, labels, self.bias, shift_labels=shift_labels,
                              ignore_index=ignore_index, softcap=self.softcap,
                              z_loss_weight=self.z_loss_weight,
                              num_items_in_batch=num_items_in_batch, chunk_mib=self.chunk_mib)
