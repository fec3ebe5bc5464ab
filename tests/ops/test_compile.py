"""Every kernel compiles to a Hopper (sm_90) cubin, checked on a machine without a GPU.

The interpreter runs kernels as numpy and accepts code that the compiler rejects. Triton ships
ptxas in its wheel, so CI can run the real compiler down to machine code for the H200. Triton's
mode is fixed when it is imported, and these tests' process imported it to interpret, so the
compilation runs in a fresh process (about 13 s with a cold Triton cache: bf16 only, and the
softcapped, gradient-writing variant of the loss kernel, which contains the others' code).
On a GPU machine the GPU tests compile the kernels instead.
"""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile them there")

P, N, F = "*{}", "i32", "fp32"  # pointer (to a dtype), integer, float scalar


def _kernels(dtype: str):
    import lightning_slide.ops.cross_entropy as lce
    import lightning_slide.ops.glu as glu
    import lightning_slide.ops.master_halves as halves
    import lightning_slide.ops.moment_codes as codes
    import lightning_slide.ops.norm as norm
    import lightning_slide.ops.rotary as rotary

    p = P.format(dtype)
    rope = [p] * 6 + [N] * 15
    ce = [p, N, "*i64", "*fp32", "*fp32", N, N, F, F]
    return {
        "rms_norm_fwd": (norm._fwd, [p, p, p, "*fp32", N, N, N, N, F], {"BLOCK_M": 1, "BLOCK_N": 4096}),
        "rms_norm_bwd": (norm._bwd, [p, p, p, "*fp32", p, "*fp32"] + [N] * 6, {"BLOCK_M": 32, "BLOCK_N": 128}),
        "rope_bwd": (rotary._rope, rope, {"HQ": 32, "HK": 8, "HALF": 64, "BACKWARD": True, "BLOCK_T": 1,
                                          "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": 64}),
        "swiglu_fwd": (glu._fwd, [p, p, p, N], {"BLOCK": glu.BLOCK}),
        "swiglu_bwd": (glu._bwd, [p, p, p, p, p, N], {"BLOCK": glu.BLOCK}),
        "ce_rows_softcap": (lce._ce_rows, ce, {"HAS_SOFTCAP": True, "WRITE_GRAD": True, "BLOCK": lce.CE_BLOCK}),
        "scale": (lce._scale, [p, "*fp32", N], {"BLOCK": 4096}),
        "decode_int8": (codes._decode, ["*u8", "*fp32", "*fp32", N],
                        {"SIGNED": True, "SHIFT": 20, "KEEP": 0, "BLOCK": 256, "ROWS": codes.ROWS}),
        "encode_int8": (codes._encode, ["*fp32", "*u8", "*fp32", "*i32", N, "i64"],
                        {"SIGNED": False, "SHIFT": 20, "BLOCK": 256, "ROWS": codes.ROWS, "PERIOD": 1 << 20,
                         "PIECE": 1 << 16}),
        "encode_bf16": (codes._encode_bf16, ["*fp32", "*i16", "*i32", N, "i64"],
                        {"PERIOD": 1 << 20, "PIECE": 1 << 16, "BLOCK": codes.BF16_BLOCK}),
        "split_master": (halves._split, ["*fp32", "*i16", "*i16", "*u8", N, "i32", "i32"],
                         {"BLOCK": halves.BLOCK, "LOW_BITS": 16}),
        "split_master_24_bits": (halves._split, ["*fp32", "*i16", "*i8", "*u8", N, "u32", "i32"],
                                 {"BLOCK": halves.BLOCK, "LOW_BITS": 8}),
        "join_master": (halves._join, ["*i16", "*i16", "*u8", "*fp32", N], {"BLOCK": halves.BLOCK, "LOW_BITS": 16}),
        "join_master_24_bits": (halves._join, ["*i16", "*i8", "*u8", "*fp32", N],
                                {"BLOCK": halves.BLOCK, "LOW_BITS": 8}),
    }


def compile_all(dtype: str) -> None:
    """Compile every kernel for sm_90 (runs in the child process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    for name, (fn, types, constexprs) in _kernels(dtype).items():
        params = list(inspect.signature(fn).parameters)
        signature = dict(zip(params, types, strict=False)) | {k: "constexpr" for k in constexprs}
        assert list(signature) == params, name
        compiled = triton.compile(ASTSource(JITFunction(fn), signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], name
        print("compiled", name, dtype)


def test_every_kernel_compiles_for_sm90_in_bf16():
    here = Path(__file__).parent
    script = (f"import sys; sys.path.insert(0, {str(here)!r}); import test_compile as t; "
              "t.compile_all('bf16')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=here.parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(_kernels("bf16"))
