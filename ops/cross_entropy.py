"""Fused linear cross-entropy: `mean CE(hidden @ W.T (+ b), targets)` without the full logits.

For 16k tokens and a 128k vocabulary the fp32 logits alone are 8 GiB. The logits are computed a block at a
time into one reused buffer of `chunk_mib` (default 63 MiB: the transient memory stays under 64 MiB), and the
gradients are finished during the forward (backward only scales them by the incoming gradient). Every schedule
shares the logits GEMM (cuBLAS, input dtype, fp32 accumulation) and row-wise Triton kernels that turn a block
of logits into d(loss)/d(logits) in place. The schedules (`schedule=`) trade GEMM shape against recomputation:

- `"rows"`: chunks of whole rows; per chunk grad_x = dlogits @ W and grad_W += dlogits.T @ x_c. 6·T·H·V FLOPs
  (as Liger-Kernel; Cut Cross-Entropy recomputes, 8·T·H·V), but every chunk reads and writes all of grad_W:
  8·T·V²·H/B bytes for a buffer of B bytes (~125 GiB at 16k tokens, vocab 128256, hidden 4096), memory-bound.
- `"vocab"`: vocabulary slices over all rows in two passes (an online log-sum-exp, 3 fp32 a row; then each
  slice's logits again, into gradients): grad_W[slice] is written once and grad_x accumulated per slice,
  8·V·T²·H/B bytes (T/V of the row schedule's), for a fourth GEMM (8·T·H·V FLOPs).
- `"tiles"` (the default): the vocab schedule over blocks of at least `TILE_ROWS` (512) rows, the vocabulary cut
  into the fewest equal slices that fit beside them (two at 128256, three at 151936). 7·T·H·V FLOPs at two
  slices, and a block's grad_W update does 256 FLOPs per byte it moves, above the H200's ~200 FLOP/B ridge.
  On an H200 (bf16, hidden 4096, 4k-64k tokens, vocab 128256 and 151936) it is the fastest of the three in four
  of six shapes and within 2.2% in the other two; at 64 MiB none of them is as fast as Liger-Kernel at 16k tokens,
  which takes about twice the memory (`docs/alternatives.md` has the times).

Sums are rounded into the output dtype once per chunk, slice or block (grad_W in the weight's dtype, as Liger's
default): an fp32 accumulator for grad_x would be T·H·4 bytes, four times the buffer at 16k x 4096.

On CUDA (`overlap=True`) each block's grad_x GEMM runs on a second, high-priority stream beside its grad_W
update: grad_x has only a few hundred x 4096 outputs (about 64 tiles for 132 SMs at 256 rows), and the
memory-bound grad_W update takes the SMs it leaves. The second stream costs cuBLAS one more workspace.

Options: logit softcapping `c·tanh(z/c)`, a z-loss `w·lse²`, Hugging Face's `num_items_in_batch` normaliser,
a bias. With every label ignored the loss is 0, not NaN.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton.language as tl
from torch import nn

from ._triton import Kernel, device_function, launch_options, next_pow2, use_triton

IGNORE_INDEX = -100
CHUNK_MIB = 63.0  # logits buffer budget: keeps the transient memory under 64 MiB
CE_BLOCK = 8192  # vocabulary columns per step of the row kernels' online log-sum-exp
OVERLAP = True  # default: a block's grad_x GEMM runs on a second CUDA stream beside its grad_W update
SCHEDULES = ("rows", "vocab", "tiles")
SCHEDULE = "tiles"  # default: see the module docstring
TILE_ROWS = 512  # the tiles schedule's fewest rows per block: its grad_W update is then compute-bound


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
    n = valid.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=valid.device)
    return n.to(torch.float32).clamp(min=1.0)


# ---------------------------------------------------------------- row-wise kernels
# One program per row of a block of logits: all columns (the row schedule) or one vocabulary
# slice (the vocab schedule, whose column c of the slice is vocabulary entry c0 + c).


@device_function
def _logits(P, c, V, softcap, HAS_SOFTCAP: tl.constexpr):
    """The logits at columns `c` in fp32 (softcapped, `softcap·tanh(z/softcap)`, when asked); -inf past V."""
    mask = c < V
    z = tl.load(P + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return tl.where(mask, z, float("-inf"))


@device_function
def _row_lse(P, V, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """The row's max m and sum(exp(z - m)) over its V columns.

    Online per lane (a running max and sum for each of the BLOCK columns a step loads), so the
    loop over the vocabulary has no cross-warp reduction between its loads; the lanes are
    combined once at the end.
    """
    cols = tl.arange(0, BLOCK)
    m = _logits(P, cols, V, softcap, HAS_SOFTCAP)  # full unless V < BLOCK: no -inf in later steps' m
    s = tl.where(cols < V, 1.0, 0.0)
    for off in range(BLOCK, V, BLOCK):
        z = _logits(P, off + cols, V, softcap, HAS_SOFTCAP)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    return m_row, tl.sum(s * tl.exp(m - m_row), axis=0)


@device_function
def _store_loss(LOSS, row, lse, zy, valid, INV, z_w):
    """Store the row's loss `(lse - z_y + w·lse²) / N` (0 for an ignored label); return its scale."""
    scale = tl.where(valid, tl.load(INV), 0.0)
    tl.store(LOSS + row, (lse - zy + z_w * lse * lse) * scale)
    return scale


@device_function
def _store_dlogits(P, V, target, lse, scale, z_w, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Overwrite the row's V logits with d(loss)/d(logits); `target`: the label's column (may be outside).

    d/dz [lse - z_y + w·lse²] = p·(1 + 2w·lse) - onehot(y), times the softcap's slope.
    """
    coef = 1.0 + 2.0 * z_w * lse
    cols = tl.arange(0, BLOCK)
    for off in range(0, V, BLOCK):
        c = off + cols
        mask = c < V
        z = _logits(P, c, V, softcap, HAS_SOFTCAP)
        g = (tl.exp(z - lse) * coef - tl.where(c == target, 1.0, 0.0)) * scale
        if HAS_SOFTCAP:
            t = tl.where(mask, z / softcap, 0.0)  # tanh of the raw logit
            g = g * (1.0 - t * t)
        tl.store(P + c, g.to(P.dtype.element_ty), mask=mask)


def _ce_rows(L, stride_l, Y, LOSS, INV, V, ignore_index, softcap, z_w,
             HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One whole row (the row schedule): its log-sum-exp, its loss, then dlogits over the logits."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    y = tl.load(Y + row)
    valid = y != ignore_index
    m, s = _row_lse(base, V, softcap, HAS_SOFTCAP, BLOCK)
    lse = m + tl.log(s)
    zy = _logits(base, tl.where(valid, y, 0), V, softcap, HAS_SOFTCAP)
    scale = _store_loss(LOSS, row, lse, zy, valid, INV, z_w)
    if WRITE_GRAD:
        _store_dlogits(base, V, y, lse, scale, z_w, softcap, HAS_SOFTCAP, BLOCK)


def _lse_slice(L, stride_l, Y, LOSS, INV, V, ignore_index, softcap, z_w, M, S, ZY, c0,
               HAS_SOFTCAP: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 of the vocab schedule, one row of a slice: fold its V columns into the running
    max M and sum S, and pick up the target's logit ZY if it lies here. After the LAST slice, M
    holds the log-sum-exp and the row's loss is stored."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    y = tl.load(Y + row)
    valid = y != ignore_index
    m_here, s_here = _row_lse(base, V, softcap, HAS_SOFTCAP, BLOCK)
    m_old = tl.load(M + row)  # -inf before the first slice: exp(m_old - m) = 0 (m_here is finite)
    m = tl.maximum(m_old, m_here)
    s = tl.load(S + row) * tl.exp(m_old - m) + s_here * tl.exp(m_here - m)
    col = y - c0
    here = valid & (col >= 0) & (col < V)
    zy = tl.where(here, _logits(base, tl.where(here, col, 0), V, softcap, HAS_SOFTCAP), tl.load(ZY + row))
    if LAST:
        lse = m + tl.log(s)
        _store_loss(LOSS, row, lse, zy, valid, INV, z_w)
        tl.store(M + row, lse)
    else:
        tl.store(M + row, m)
        tl.store(S + row, s)
        tl.store(ZY + row, zy)


def _grad_slice(L, stride_l, Y, LSE, INV, V, ignore_index, softcap, z_w, c0,
                HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2 of the vocab schedule, one row of a slice: dlogits over its logits, given the row's lse."""
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(Y + row)
    scale = tl.where(y != ignore_index, tl.load(INV), 0.0)
    _store_dlogits(L + row * stride_l, V, y - c0, tl.load(LSE + row), scale, z_w, softcap, HAS_SOFTCAP, BLOCK)


def _scale(X, S, n, BLOCK: tl.constexpr):
    """x *= s, with s an fp32 device scalar (a bf16 `mul_` would round s first)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * tl.load(S).to(tl.float32)).to(X.dtype.element_ty), mask=mask)


_ce_rows_kernel = Kernel(_ce_rows)
_lse_slice_kernel = Kernel(_lse_slice)
_grad_slice_kernel = Kernel(_grad_slice)
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
    schedule: str = SCHEDULE

    @property
    def write_grad(self) -> bool:
        return self.need_grad_x or self.need_grad_w or self.need_grad_b


def _launch(kernel: Kernel, logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor, inv: torch.Tensor,
            o: _Options, *extra, **constexprs) -> None:
    """One program per row of `logits`, with the arguments every row kernel starts with."""
    block = min(next_pow2(logits.shape[1]), CE_BLOCK)
    kernel[(logits.shape[0],)](
        logits, logits.stride(0), targets, out, inv, logits.shape[1], o.ignore_index, float(o.softcap or 1.0),
        float(o.z_loss_weight), *extra, HAS_SOFTCAP=o.softcap is not None, BLOCK=block, **constexprs,
        **launch_options(min(16, max(4, block // 256))))


# The same row-wise steps in PyTorch, for the CPU without the interpreter: same outputs, same
# in-place writes. A whole row is a slice of one.


def _capped(logits: torch.Tensor, o: _Options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits, softcapped when asked, and the tanh (for the softcap's slope)."""
    z = logits.float()
    if o.softcap is None:
        return z, None
    t = torch.tanh(z / o.softcap)
    return o.softcap * t, t


def _lse_slice_torch(logits, targets, c0: int, state, loss, inv, o: _Options, last: bool) -> None:
    z, _ = _capped(logits, o)
    m, s, zy = state
    m_new = torch.maximum(m, z.amax(1))
    s.copy_(s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1))
    m.copy_(m_new)
    valid = targets != o.ignore_index
    col = targets - c0
    here = valid & (col >= 0) & (col < z.shape[1])
    zy.copy_(torch.where(here, z.gather(1, torch.where(here, col, 0)[:, None]).squeeze(1), zy))
    if last:
        m += torch.log(s)
        loss.copy_((m - zy + o.z_loss_weight * m * m) * torch.where(valid, inv, 0.0))


def _grad_slice_torch(logits, targets, c0: int, lse, inv, o: _Options) -> None:
    z, t = _capped(logits, o)
    col = targets - c0
    here = (targets != o.ignore_index) & (col >= 0) & (col < z.shape[1])
    g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * o.z_loss_weight * lse)[:, None]
    g.scatter_add_(1, torch.where(here, col, 0)[:, None], -here[:, None].to(g.dtype))
    g *= torch.where(targets != o.ignore_index, inv, 0.0)[:, None]
    if t is not None:
        g *= 1.0 - t * t
    logits.copy_(g)


def _lse_state(tokens: int, device: torch.device) -> torch.Tensor:
    """Per row: running max (then the log-sum-exp), running sum, target logit; fp32."""
    state = torch.zeros((3, tokens), dtype=torch.float32, device=device)
    state[0] = float("-inf")
    return state


def _rows(logits, targets, loss, inv, o: _Options) -> None:
    """Loss rows for whole rows of logits, overwritten with dlogits when gradients are wanted."""
    if use_triton(logits):
        _launch(_ce_rows_kernel, logits, targets, loss, inv, o, WRITE_GRAD=o.write_grad)
        return
    state = _lse_state(logits.shape[0], logits.device)
    _lse_slice_torch(logits, targets, 0, state, loss, inv, o, last=True)
    if o.write_grad:
        _grad_slice_torch(logits, targets, 0, state[0], inv, o)


def _slice_lse(logits, targets, c0: int, state, loss, inv, o: _Options, last: bool) -> None:
    """Pass 1 over one vocabulary slice (columns c0 onwards) of every row."""
    if use_triton(logits):
        _launch(_lse_slice_kernel, logits, targets, loss, inv, o, *state, c0, LAST=last)
    else:
        _lse_slice_torch(logits, targets, c0, state, loss, inv, o, last)


def _slice_grad(logits, targets, c0: int, lse, inv, o: _Options) -> None:
    """Pass 2 over one vocabulary slice: its logits become dlogits."""
    if use_triton(logits):
        _launch(_grad_slice_kernel, logits, targets, lse, inv, o, c0)
    else:
        _grad_slice_torch(logits, targets, c0, lse, inv, o)


# ---------------------------------------------------------------- schedules


def _fit(n: int, total: int, align: int) -> int:
    """`n` items of `total` per block: all if they fit, else a multiple of `align` (of 8 below 8·align)."""
    if n >= total:
        return max(total, 1)
    for a in (align, 8):
        if n >= 8 * a:
            return n // a * a
    return n


def chunk_rows(tokens: int, vocab: int, element_size: int, chunk_mib: float = CHUNK_MIB) -> int:
    """Tokens per chunk so that one chunk's logits fit the budget (a multiple of 8 when large)."""
    return _fit(max(1, int(chunk_mib * 2**20) // (vocab * element_size)), tokens, 8)


def slice_cols(tokens: int, vocab: int, element_size: int, chunk_mib: float = CHUNK_MIB) -> int:
    """Vocabulary columns per slice so that all tokens' logits of a slice, and the per-row state
    of the online log-sum-exp (3 fp32 a token), fit the budget (a multiple of 128, cuBLAS's tile
    width, from 1024 columns on; of 8, for aligned rows, from 64)."""
    budget = int(chunk_mib * 2**20) - 12 * tokens
    return _fit(max(1, budget // (max(tokens, 1) * element_size)), vocab, 128)


def tile_shape(tokens: int, vocab: int, element_size: int, chunk_mib: float = CHUNK_MIB,
               min_rows: int | None = None) -> tuple[int, int]:
    """Rows and vocabulary columns of the tiles schedule's blocks: the fewest equal slices of the vocabulary
    (a multiple of 128 columns from 1024 on) that leave room in the budget for `min_rows` rows (default
    `TILE_ROWS`), or for every token, with their online log-sum-exp state (3 fp32 a row)."""
    budget, want = int(chunk_mib * 2**20), min(tokens, TILE_ROWS if min_rows is None else min_rows)
    slices = -(-vocab // max(1, (budget // want - 12) // element_size))
    cols = -(-vocab // slices)
    cols = min(vocab, -(-cols // 128) * 128) if cols >= 1024 else cols
    return _fit(max(1, budget // (cols * element_size + 12)), tokens, 64), cols


def _logits_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second, high-priority stream of a device (one per device, so one extra cuBLAS workspace)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


class _GradXBeside:
    """Runs each block's grad_x GEMM on the side stream, beside the grad_W update that the current stream
    queues after it (`overlap`, on CUDA, when both gradients are wanted); in order otherwise.

    grad_x starts once the block's dlogits are queued, and the buffer's next write waits until grad_x has
    read it. Everything the side stream touches is allocated before the first block and lives through the
    call, and `join` makes the current stream wait for the side stream at the end, so the caching
    allocator never hands out memory that the side stream may still read.
    """

    def __init__(self, x: torch.Tensor, o: _Options, gx, gw) -> None:
        on = o.overlap and x.is_cuda and gx is not None and gw is not None
        self.device = x.device
        self.stream = _side_stream(x.device) if on else None
        self.read: torch.cuda.Event | None = None

    def before_write(self) -> None:
        if self.read is not None:
            torch.cuda.current_stream(self.device).wait_event(self.read)

    @contextmanager
    def grad_x(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        self.read = self.stream.record_event()

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _row_chunks(x, w, b, y, inv, o: _Options, loss_rows, gx, gw, gb) -> None:
    """The row schedule: chunks of whole rows through one logits buffer."""
    T, V = x.shape[0], w.shape[0]
    rows = chunk_rows(T, V, x.element_size(), o.chunk_mib)
    buf = torch.empty((rows, V), dtype=x.dtype, device=x.device)
    beside = _GradXBeside(x, o, gx, gw)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        xc, lc = x[s:e], buf[: e - s]
        beside.before_write()
        _logits_into(lc, xc, w, b)
        _rows(lc, y[s:e], loss_rows[s:e], inv, o)
        if gx is not None:
            with beside.grad_x():
                torch.mm(lc, w, out=gx[s:e])
        if gw is not None:
            if s == 0:
                torch.mm(lc.t(), xc, out=gw)
            else:
                gw.addmm_(lc.t(), xc)
        if gb is not None:
            gb += lc.sum(0, dtype=torch.float32)
    beside.join()


def _slices(x, w, b, y, inv, o: _Options, loss_rows, gx, gw, gb, rows: int, cols: int) -> None:
    """The vocab and tiles schedules: blocks of `rows` rows, each through vocabulary slices of `cols`
    columns, first folded into an online log-sum-exp, then walked back into their gradients."""
    T, V = x.shape[0], w.shape[0]
    buf = torch.empty(min(rows, T) * cols, dtype=x.dtype, device=x.device)
    slices = [(c, min(c + cols, V)) for c in range(0, V, cols)]
    beside = _GradXBeside(x, o, gx, gw)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        _slices_of_block(x[s:e], w, b, y[s:e], inv, o, loss_rows[s:e], gx[s:e] if gx is not None else None,
                         gw, gb, buf, slices, beside, first=s == 0)
    beside.join()


def _slices_of_block(x, w, b, y, inv, o: _Options, loss_rows, gx, gw, gb, buf, slices, beside: _GradXBeside,
                     first: bool) -> None:
    """One block of rows: pass 1 over every slice, then each slice's dlogits and gradient GEMMs, the last
    slice first (its logits are still in the buffer). grad_W and the bias gradient add to what earlier
    blocks wrote; grad_x is this block's own."""
    T = x.shape[0]
    state = _lse_state(T, x.device)

    def logits(c0: int, c1: int, compute: bool = True) -> torch.Tensor:
        out = buf[: T * (c1 - c0)].view(T, c1 - c0)
        if compute:
            beside.before_write()
            _logits_into(out, x, w[c0:c1], b[c0:c1] if b is not None else None)
        return out

    for i, (c0, c1) in enumerate(slices):
        _slice_lse(logits(c0, c1), y, c0, state, loss_rows, inv, o, last=i == len(slices) - 1)
    if not o.write_grad:
        return
    for i, (c0, c1) in enumerate(reversed(slices)):
        lc = logits(c0, c1, compute=i > 0)
        _slice_grad(lc, y, c0, state[0], inv, o)
        if gx is not None:
            with beside.grad_x():
                if i == 0:
                    torch.mm(lc, w[c0:c1], out=gx)
                else:
                    gx.addmm_(lc, w[c0:c1])
        if gw is not None:
            if first:
                torch.mm(lc.t(), x, out=gw[c0:c1])
            else:
                gw[c0:c1].addmm_(lc.t(), x)
        if gb is not None:
            gb[c0:c1] += lc.sum(0, dtype=torch.float32)


def _loss_and_grads(x, w, b, y, inv, o: _Options):
    """Run the schedule: returns the loss and the finished (unscaled) gradients."""
    T, V = x.shape[0], w.shape[0]
    loss_rows = torch.zeros(T, dtype=torch.float32, device=x.device)
    gx = torch.empty_like(x) if o.need_grad_x else None
    gw = (torch.empty_like(w) if T else torch.zeros_like(w)) if o.need_grad_w else None
    gb = torch.zeros(V, dtype=torch.float32, device=x.device) if o.need_grad_b else None
    if T and o.schedule == "rows":
        _row_chunks(x, w, b, y, inv, o, loss_rows, gx, gw, gb)
    elif T:
        rows, cols = ((T, slice_cols(T, V, x.element_size(), o.chunk_mib)) if o.schedule == "vocab"
                      else tile_shape(T, V, x.element_size(), o.chunk_mib))
        _slices(x, w, b, y, inv, o, loss_rows, gx, gw, gb, rows, cols)
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
                         chunk_mib: float = CHUNK_MIB, overlap: bool | None = None,
                         schedule: str = SCHEDULE) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T (+ bias)` against `targets` (already aligned).

    The mean is over non-ignored targets, or the sum divided by `num_items_in_batch` when given
    (HF's convention under gradient accumulation). Returns an fp32 scalar. `chunk_mib` bounds the
    logits buffer(s); `schedule` is one of `SCHEDULES` (module docstring); `overlap` (default
    `OVERLAP`) lets grad_x run on a second CUDA stream.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"linear_cross_entropy: schedule {schedule!r} is not one of {SCHEDULES}")
    x, w, b = _autocast(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    y = targets.reshape(-1).to(device=x.device, dtype=torch.long).contiguous()  # the kernels index it as one row
    grad = torch.is_grad_enabled()
    o = _Options(ignore_index, softcap, float(z_loss_weight), chunk_mib, OVERLAP if overlap is None else overlap,
                 need_grad_x=grad and x.requires_grad, need_grad_w=grad and w.requires_grad,
                 need_grad_b=grad and b is not None and b.requires_grad, schedule=schedule)
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
    schedule: str = SCHEDULE

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, *,
                shift_labels: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        if labels is None and shift_labels is None:
            logits = F.linear(hidden, self.weight, self.bias)
            return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)
        return causal_lm_loss(hidden, self.weight, labels, self.bias, shift_labels=shift_labels,
                              ignore_index=ignore_index, softcap=self.softcap,
                              z_loss_weight=self.z_loss_weight,
                              num_items_in_batch=num_items_in_batch, chunk_mib=self.chunk_mib,
                              schedule=self.schedule)
