"""Triton kernels for fine-tuning Llama / Qwen2 / Qwen3 / Mistral, each with its PyTorch reference.

One module per kernel (reference, Triton kernel, autograd.Function, functional and nn.Module face):
`norm` (RMSNorm), `rotary` (RoPE), `glu` (SwiGLU), `cross_entropy` (fused linear cross-entropy),
`tiled_mlp` (the SwiGLU MLP over sequence tiles: `ops.tiled_mlp.tiled_mlp`), `grouped_attention` (SDPA a
group of key/value heads at a time: `ops.grouped_attention.grouped_attention`); `hf_patch` (`ops.patch`)
swaps them into a Hugging Face model; `moment_codes` decodes and encodes compact Adam moments for the GPU updater.
Kernels run for CUDA tensors, and for CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
for tests); anywhere else each op falls back to its pure-PyTorch reference, so a patched model
still trains correctly on a CPU.

The folder sits at the repository's top and installs as `lightning_slide.ops` (pyproject.toml maps
it there); its modules import one another relatively and use neither Lightning nor the rest of the
package.
"""
from .cross_entropy import (
    LinearCrossEntropyHead,
    causal_lm_loss,
    causal_targets,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from .glu import SwiGLUMLP, swiglu, swiglu_reference
from .grouped_attention import GroupedAttention, attention_reference
from .hf_patch import PatchHandle, patch, supports, unpatch
from .norm import RMSNorm, rms_norm, rms_norm_reference
from .rotary import apply_rotary_pos_emb, rope_reference
from .tiled_mlp import TiledMLPFunction, tile_for, tiled_mlp_reference

__all__ = [
    "GroupedAttention", "LinearCrossEntropyHead", "PatchHandle", "RMSNorm", "SwiGLUMLP", "TiledMLPFunction",
    "apply_rotary_pos_emb", "attention_reference", "causal_lm_loss", "causal_targets", "linear_cross_entropy",
    "linear_cross_entropy_reference", "patch", "rms_norm", "rms_norm_reference", "rope_reference", "supports",
    "swiglu", "swiglu_reference", "tile_for", "tiled_mlp_reference", "unpatch",
]
