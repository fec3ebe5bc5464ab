"""SwiGLU's elementwise core, `silu(gate) * up`, as in the Llama/Qwen/Mistral MLP.

Eager PyTorch runs silu, then the product, writing and re-reading an intermediate; the backward
recomputes silu and launches several more kernels. Here the forward reads gate and up once and
writes the product once; the backward reads (gate, up, grad) once and writes both input grads,
recomputing the sigmoid instead of saving it. Math in fp32, one rounding to the storage dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.language as tl
from torch import nn

from ._triton import Kernel, launch_options, use_triton

BLOCK = 2048


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the HF MLP computes between its projections: `act_fn(gate_proj(x)) * up_proj(x)`."""
    return F.silu(gate) * up


def _fwd(A, B, C, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(C + offs, c.to(C.dtype.element_ty), mask=mask)


def _bwd(DC, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    tl.store(DA + offs, (dc * b * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dc * silu).to(DB.dtype.element_ty), mask=mask)


_fwd_kernel = Kernel(_fwd)
_bwd_kernel = Kernel(_bwd)


def _grid(n: int) -> tuple[int]:
    return (-(-n // BLOCK),)


def _launch_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _fwd_kernel[_grid(gate.numel())](gate, up, out, gate.numel(), BLOCK=BLOCK, **launch_options(8))
    return out


def _launch_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor,
                dup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _bwd_kernel[_grid(gate.numel())](dout, gate, up, dgate, dup, gate.numel(), BLOCK=BLOCK, **launch_options(8))
    return dgate, dup


class SwiGLUFunction(torch.autograd.Function):
    """Triton `silu(gate) * up`; saves gate and up (no extra activation memory)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _launch_fwd(gate, up, torch.empty_like(gate))

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _launch_bwd(dout.contiguous(), gate, up, torch.empty_like(gate), torch.empty_like(up))


def _kernel_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return use_triton(gate) and gate.shape == up.shape and gate.dtype == up.dtype


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`: Triton when it applies (same shape and dtype), else the reference."""
    if _kernel_applies(gate, up):
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)


def swiglu_into_(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` written into `out` (no autograd), which may be `gate` itself: for callers that keep no
    graph and want no further buffer. Each element is read before its result is stored (the kernel's store
    depends on both of its loads)."""
    if _kernel_applies(gate, up) and all(t.is_contiguous() for t in (out, gate, up)) and out.shape == gate.shape:
        return _launch_fwd(gate, up, out)
    return out.copy_(swiglu_reference(gate, up))


def swiglu_backward_(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `silu(gate) * up` for `dout`, written over `gate` and `up` (no autograd): what
    SwiGLUFunction's backward computes, in the memory of its inputs. Without the kernel: autograd's `silu`
    derivative, `sigmoid(g) * (1 + g * (1 - sigmoid(g)))`, in fp32 and rounded once, as the kernel does."""
    if _kernel_applies(gate, up) and all(t.is_contiguous() for t in (dout, gate, up)) and dout.shape == gate.shape:
        return _launch_bwd(dout, gate, up, gate, up)
    g, u, d = gate.float(), up.float(), dout.float()
    sig = torch.sigmoid(g)
    dgate = (d * u) * (sig * (1 + g * (1 - sig)))
    up.copy_(d * F.silu(g))
    return gate.copy_(dgate), up


class SwiGLUMLP(nn.Module):
    """The Llama MLP, `down(silu(gate(x)) * up(x))`, with the fused elementwise core."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
