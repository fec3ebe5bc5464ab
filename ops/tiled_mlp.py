"""The SwiGLU MLP, `down(silu(gate(x)) * up(x))`, over sequence tiles: no tokens x intermediate tensor of the
whole sequence ever exists.

Why: the MLP is the widest part of a Llama block. Per token its forward makes gate, up and their product, each
`intermediate` wide (14336 for Llama-3.1-8B, 3.5x the hidden size), and its backward as many gradients; at
131,072 tokens one such bf16 tensor takes 3.5 GiB. The MLP works token by token, so it can run a tile of
tokens at a time: the forward computes each tile's output and keeps only the input `x`; the backward
recomputes each tile's gate and up from `x` and adds the tile's share to the weight gradients (the TiledMLP
of Arctic Long Sequence Training, arXiv 2506.13996). The transient memory is then at most
`TILE_TENSORS` tile x intermediate tensors, whatever the sequence length. The price is the gate and up
GEMMs once more in the backward (two of the MLP's twelve GEMMs of a recomputed training step), so short
sequences run untiled (`tile_for`).

In the forward a tile's product is written over its gate (`glu.swiglu_into_`). In the backward the product
gets a buffer of its own (the down projection's weight gradient reads it), which then takes the product's
gradient, and gate and up are overwritten by theirs (`glu.swiglu_backward_`): three buffers a tile.
Weight gradients accumulate across tiles in the weights' dtype (each tile's GEMM accumulates in fp32, the
sum is rounded once per tile).
The weights are saved with `save_for_backward`, so saved-tensor hooks see them (a runtime that keeps the
graph while the weights' memory serves other layers can save them as places).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .glu import swiglu_backward_, swiglu_into_, swiglu_reference

MiB = 2**20
UNTILED_MIB = 1024  # "auto": a micro-batch whose one tokens x intermediate tensor is at most this runs untiled
TILE_MIB = 256  # "auto": beyond that, tiles whose tokens x intermediate tensor is at most this
TILE_TENSORS = 3  # tile x intermediate buffers the backward holds at once (the forward: two)
TileSetting = int | Literal["auto"] | None


def tiled_mlp_reference(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
                        down_w: torch.Tensor) -> torch.Tensor:
    """What Hugging Face's Llama/Qwen/Mistral MLP computes (no biases), all tokens at once."""
    return F.linear(swiglu_reference(F.linear(x, gate_w), F.linear(x, up_w)), down_w)


def tile_for(setting: TileSetting, tokens: int, intermediate: int, itemsize: int) -> int | None:
    """Tokens per tile for a micro-batch of `tokens`, or None: untiled.

    None never tiles; an int tiles whenever there are more tokens than that. "auto" runs untiled while one
    tokens x intermediate tensor takes at most UNTILED_MIB: up to there the untiled MLP fits beside the rest of
    a 24 GiB budget (Llama-3.1-8B at 32,768 tokens and Llama-3.2-3B at 65,536 trained untiled under it, on an
    H200) and the tiles' extra GEMMs are not worth paying. Beyond, equal tiles of at most TILE_MIB per such
    tensor (9,362 tokens at intermediate 14336 in bf16): TILE_TENSORS of them are 0.75 GiB, and a
    9,362 x 4096 x 14336 GEMM is still large enough to run at full rate.
    """
    if setting is None:
        return None
    if setting != "auto":
        return setting if tokens > setting else None
    if tokens * intermediate * itemsize <= UNTILED_MIB * MiB:
        return None
    return even_tiles(tokens, intermediate, itemsize)


def even_tiles(tokens: int, intermediate: int, itemsize: int) -> int | None:
    """Tokens per tile in equal tiles of at most TILE_MIB per tokens x intermediate tensor; None where one tile
    takes every token."""
    tiles = -(-tokens // max(1, int(TILE_MIB * MiB // (intermediate * itemsize))))
    return None if tiles == 1 else -(-tokens // tiles)


def tile_bytes(tile: int, intermediate: int, itemsize: int) -> int:
    """The transient memory of a tiled MLP's backward: TILE_TENSORS tile x intermediate buffers."""
    return TILE_TENSORS * tile * intermediate * itemsize


def check_tile_setting(setting: object, name: str = "mlp_tile_tokens") -> None:
    """A tile setting is None, "auto" or a positive int; anything else is named."""
    if not (setting is None or setting == "auto" or (type(setting) is int and setting > 0)):
        raise ValueError(f"{name}={setting!r} is not valid: give a positive number of tokens per tile, "
                         "'auto' (tiles only for long sequences), or None (never tiled).")


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, in place (a @ b alone for the first tile)."""
    return torch.mm(a, b) if acc is None else acc.addmm_(a, b)


def _gate_up(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.mm(x, gate_w.t()), torch.mm(x, up_w.t())


class TiledMLPFunction(torch.autograd.Function):
    """The MLP over tiles of `tile` tokens (the last one ragged); saves only its input and the weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                tile: int) -> torch.Tensor:
        ctx.save_for_backward(x, gate_w, up_w, down_w)
        ctx.tile = tile
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape[0], down_w.shape[0])
        for start in range(0, flat.shape[0], tile):
            gate, up = _gate_up(flat[start:start + tile], gate_w, up_w)
            product = swiglu_into_(gate, gate, up)
            torch.mm(product, down_w.t(), out=out[start:start + tile])
            del gate, up, product  # freed before the next tile's are made
        return out.view(*x.shape[:-1], down_w.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        x, gate_w, up_w, down_w = ctx.saved_tensors
        flat, grad = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        dx = torch.empty_like(flat) if need_x else None
        d_gate = d_up = d_down = None
        for start in range(0, flat.shape[0], ctx.tile):
            tile = slice(start, start + ctx.tile)
            xt, dyt = flat[tile], grad[tile]
            gate, up = _gate_up(xt, gate_w, up_w)
            product = swiglu_into_(torch.empty_like(gate), gate, up)
            if need_down:
                d_down = _accumulate(d_down, dyt.t(), product)
            d_gate_t, d_up_t = swiglu_backward_(torch.mm(dyt, down_w, out=product), gate, up)
            del product
            if need_gate:
                d_gate = _accumulate(d_gate, d_gate_t.t(), xt)
            if need_up:
                d_up = _accumulate(d_up, d_up_t.t(), xt)
            if need_x:
                torch.mm(d_gate_t, gate_w, out=dx[tile]).addmm_(d_up_t, up_w)
            del gate, up, d_gate_t, d_up_t  # freed before the next tile's are made
        return (None if dx is None else dx.view_as(x)), d_gate, d_up, d_down, None


def tiled_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
              tile: int) -> torch.Tensor:
    """`tiled_mlp_reference(x, ...)` over tiles of `tile` tokens. Under autocast the inputs are cast to its dtype
    first (as `F.linear` would cast them), and the tiles run in that dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, gate_w, up_w, down_w = (t.to(dtype) for t in (x, gate_w, up_w, down_w))
    with torch.autocast(device, enabled=False):
        return TiledMLPFunction.apply(x, gate_w, up_w, down_w, tile)


def compute_itemsize(x: torch.Tensor) -> int:
    """Bytes per element the MLP computes `x` in: the autocast dtype's where autocast is on, else x's."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return dtype.itemsize
