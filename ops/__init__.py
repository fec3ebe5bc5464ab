"""Triton kernels for fine-tuning Llama / Qwen2 / Qwen3 / Mistral, each with its PyTorch reference.

One module per kernel (reference, Triton kernel, autograd.Function, functional and nn.Module face):
`rms_norm`, `rope`, `swiglu`, `linear_cross_entropy`; `patch` swaps them into a Hugging Face model.
Kernels run for CUDA tensors, and for CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
for tests); anywhere else each op falls back to its pure-PyTorch reference, so a patched model
still trains correctly on a CPU. This package imports neither Lightning nor `lightning_slide`.
"""
from ops.linear_cross_entropy import (
    LinearCrossEntropyHead,
    causal_lm_loss,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    shift_labels,
)
from ops.patch import PatchHandle, patch, unpatch
from ops.rms_norm import RMSNorm, rms_norm, rms_norm_reference
from ops.rope import apply_rotary_pos_emb, rope_reference
from ops.swiglu import SwiGLUMLP, swiglu, swiglu_reference

__all__ = [
    "LinearCrossEntropyHead", "PatchHandle", "RMSNorm", "SwiGLUMLP", "apply_rotary_pos_emb",
    "causal_lm_loss", "linear_cross_entropy", "linear_cross_entropy_reference", "patch",
    "rms_norm", "rms_norm_reference", "rope_reference", "shift_labels", "swiglu",
    "swiglu_reference", "unpatch",
]
