"""One decoder block as the sliding engine runs it, with the MLP tiled and untiled and its attention over groups of
heads or in one call: time and transient memory.

The engine runs each block three times a step: a forward under no-grad, then in the backward a forward that
records the graph (the recompute) and the backward through it. This times those three (median of CUDA-event
timings) for one Llama block of a real shape with the `ops` kernels patched in, at long sequences, with
`mlp_tile_tokens="auto"` (tiles of FORCED tokens where "auto" would leave the MLP untiled) against None
(untiled), each with attention over groups of heads (`ops.grouped_attention`, where it groups at all), and
tiled with attention in one call, and measures the peak memory above the block's weights, its input and the
output gradient
(`transient_gib`: what the planner's compute workspace must cover besides the weight gradients, which are
`weight_grads_gib`), beside the planner's per-token model (`planned_gib`, from `lightning_slide.graphs`). One
JSON object per case goes to `--out/tiled_block.jsonl`; an out-of-memory case is recorded with its error.

    python -m benchmarks.tiled_block --out DIR                      # H200: about two minutes
    python -m benchmarks.tiled_block --out DIR --model llama3_3b --tokens 131072,262144
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.build import hf_config
from benchmarks.models import MODELS, ModelSpec

GIB = float(2**30)
FORCED = 8192  # tokens per tile where "auto" would leave the MLP untiled (at 32,768 tokens)


def variants(spec: ModelSpec, tokens: int) -> list[tuple[object, bool]]:
    """(MLP tiling, attention over groups of heads) compared at a length: "auto" where it tiles, else tiles of
    FORCED tokens, then untiled, each with attention grouped where it groups; and tiled in one call there."""
    tiled = "auto" if _tile(spec, tokens, "auto") else FORCED
    return [(tiled, True), (None, True)] + ([(tiled, False)] if _saving(spec, tokens) else [])


def _block(spec: ModelSpec, tokens: int, tiling: object, grouped: bool):
    """A bf16 block on the GPU with the kernels (its MLP tiled per `tiling`, its attention grouped where it
    groups if `grouped`), cos/sin for `tokens` positions."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from lightning_slide import ops

    config = hf_config(spec, tokens)
    with torch.device("cuda"):
        block = LlamaDecoderLayer(config, layer_idx=0).to(dtype=torch.bfloat16)
    for p in block.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)  # the norms
    ops.patch(block, cross_entropy=False, mlp_tile_tokens=tiling, grouped_attention=grouped)
    x = torch.randn(1, tokens, spec.hidden, device="cuda", dtype=torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config).to("cuda")(x, torch.arange(tokens, device="cuda")[None])
    return block, x, (cos, sin)


def _step(block, x: torch.Tensor, rope: tuple, dy: torch.Tensor) -> None:
    """Forward under no-grad, then the recompute and its backward with fresh leaves (as `parts.Call` does)."""
    with torch.no_grad():
        block(x, position_embeddings=rope, attention_mask=None)
    leaf = x.detach().requires_grad_()
    out = block(leaf, position_embeddings=rope, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, [leaf, *block.parameters()], dy)
    del grads


def _saving(spec: ModelSpec, tokens: int) -> int:
    from lightning_slide.ops.grouped_attention import workspace_saving

    return workspace_saving(tokens, spec.heads, spec.kv_heads, spec.head_dim, 2)


def _planned(spec: ModelSpec, tokens: int, tile: int | None, grouped: bool) -> float:
    """The planner's workspace of this block, less the weight gradients (GiB)."""
    from lightning_slide.graphs import block_workspace_bytes
    from lightning_slide.ops.tiled_mlp import tile_bytes

    buffers = None if tile is None else tile_bytes(tile, spec.intermediate, 2)
    kv = spec.kv_heads * spec.head_dim
    workspace = block_workspace_bytes(tokens, spec.hidden, spec.hidden, kv, spec.intermediate, 2, True, buffers)
    return (workspace - (_saving(spec, tokens) if grouped else 0)) / GIB


def _tile(spec: ModelSpec, tokens: int, tiling: object) -> int | None:
    from lightning_slide.ops.tiled_mlp import tile_for

    return tile_for(tiling, tokens, spec.intermediate, 2)


def measure(spec: ModelSpec, tokens: int, tiling: object, grouped: bool, repeat: int) -> dict:
    """One case: a warm-up step, then `repeat` steps, each timed and measured for its peak memory."""
    block, x, rope = _block(spec, tokens, tiling, grouped)
    dy = torch.randn_like(x)
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    _step(block, x, rope, dy)  # warm-up: kernels compiled, cuBLAS workspaces made
    times, transient = [], 0
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start.record()
        _step(block, x, rope, dy)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        transient = max(transient, torch.cuda.max_memory_allocated() - base)
    step = statistics.median(times)
    tile = _tile(spec, tokens, tiling)
    return {"model": spec.label, "tokens": tokens, "tiling": tiling, "tile_tokens": tile,
            "grouped_attention": grouped and bool(_saving(spec, tokens)), "step_s": step,
            "tflops": _flops(spec, tokens) / step / 1e12, "transient_gib": transient / GIB,
            "weight_grads_gib": weights / GIB, "planned_gib": _planned(spec, tokens, tile, grouped), "ok": True}


def _flops(spec: ModelSpec, tokens: int) -> float:
    """Model FLOPs of the three passes (forward, recompute, backward) of one block on one causal sequence."""
    linear = 2 * tokens * (spec.block_params - 2 * spec.hidden)
    attention = 2 * 2 * tokens * tokens * spec.hidden / 2  # QK^T and PV, causal half
    return 4 * (linear + attention)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="default: llama3_8b and llama3_3b")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")],
                        help="default: 32768 (the cost of tiling) and the longest ladder rung, 131072 for 8B, "
                             "262144 for 3B (its memory)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = {"llama3_8b": [32768, 131072], "llama3_3b": [32768, 262144]}
    with open(args.out / "tiled_block.jsonl", "a") as log:
        for name in args.model or ["llama3_8b", "llama3_3b"]:
            for tokens in args.tokens or lengths.get(name, [32768]):
                for tiling, grouped in variants(MODELS[name], tokens):
                    row = _run(MODELS[name], tokens, tiling, grouped, args.repeat)
                    print(json.dumps(row), flush=True)
                    log.write(json.dumps(row) + "\n")
    return 0


def _run(spec: ModelSpec, tokens: int, tiling: object, grouped: bool, repeat: int) -> dict:
    started = time.perf_counter()
    try:
        row = measure(spec, tokens, tiling, grouped, repeat)
    except torch.OutOfMemoryError as error:
        row = {"model": spec.label, "tokens": tokens, "tiling": tiling, "grouped_attention": grouped, "ok": False,
               "error": str(error)[:300]}
    torch.cuda.empty_cache()
    return {**row, "wall_s": time.perf_counter() - started}


if __name__ == "__main__":
    raise SystemExit(main())
