"""The kernels at real sizes on the GPU (hidden 4096, vocab 128256, 2k-16k tokens), in bf16.

Compared with fp32 references on the same bf16 inputs by relative error norms, which is what
matters for training at this size (single elements of a bf16 tensor are only ~3 digits).
"""
import pytest
import torch

from lightning_slide import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, V = 4096, 128256
BF16_REL = 1e-2


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all()
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_()


@pytest.mark.parametrize("tokens", [2048, 16384])
def test_rms_norm_matches_reference_at_hidden_4096(tokens):
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = _leaf(1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16))
    xr, wr = _leaf(x, torch.float32), _leaf(w, torch.float32)
    dy = torch.randn_like(x)
    y, yr = ops.rms_norm(x, w), ops.rms_norm_reference(xr, wr)
    y.backward(dy)
    yr.backward(dy.float())
    assert _rel(y, yr) < BF16_REL and _rel(x.grad, xr.grad) < BF16_REL and _rel(w.grad, wr.grad) < BF16_REL


def test_rope_matches_reference_for_llama3_8b_heads():
    b, s, hq, hk, d = 2, 4096, 32, 8, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([torch.arange(s, device="cuda").float()[:, None] * inv] * 2, -1).expand(b, s, d)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    qr, kr = _leaf(q, torch.float32), _leaf(k, torch.float32)
    qo, ko = ops.apply_rotary_pos_emb(q, k, cos, sin)
    qe, ke = ops.rope_reference(qr, kr, cos.float(), sin.float())
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (gq, gk))
    torch.autograd.backward((qe, ke), (gq.float(), gk.float()))
    for got, want in ((qo, qe), (ko, ke), (q.grad, qr.grad), (k.grad, kr.grad)):
        assert _rel(got, want) < BF16_REL


def test_swiglu_matches_reference_at_intermediate_14336():
    gate = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    gr, ur = _leaf(gate, torch.float32), _leaf(up, torch.float32)
    out, expected = ops.swiglu(gate, up), ops.swiglu_reference(gr, ur)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout.float())
    assert _rel(out, expected) < BF16_REL
    assert _rel(gate.grad, gr.grad) < BF16_REL and _rel(up.grad, ur.grad) < BF16_REL


def _lce_problem(tokens: int, vocab: int = V):
    x = (torch.randn(tokens, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, H, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[::7] = -100
    y[: tokens // 8] = -100  # a whole leading sequence ignored
    return x, w, y


SCHEDULES = list(ops.cross_entropy.SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tokens", [2048, 8192, 16384])
def test_linear_cross_entropy_matches_reference_at_vocab_128256(tokens, schedule):
    x, w, y = _lce_problem(tokens)
    xr, wr = _leaf(x), _leaf(w)  # reference: bf16 logits upcast to fp32, as HF computes them
    loss = ops.linear_cross_entropy(x, w, y, schedule=schedule)
    loss.backward()
    expected = ops.linear_cross_entropy_reference(xr, wr, y)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-3 * abs(expected.item())
    assert _rel(x.grad, xr.grad) < BF16_REL and _rel(w.grad, wr.grad) < BF16_REL


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_linear_cross_entropy_overlapped_and_serial_chunks_agree(schedule):
    """grad_x on a second stream beside the grad_W update: the numbers of one stream (a race on
    the logits buffer, such as the next chunk overwriting it before grad_x has read it, would not be)."""
    x, w, y = _lce_problem(8192)
    results = []
    for overlap in (True, False):
        x.grad = w.grad = None
        loss = ops.linear_cross_entropy(x, w, y, overlap=overlap, schedule=schedule)
        loss.backward()
        results.append((loss.detach(), x.grad, w.grad))
    for got, want in zip(*results, strict=True):
        assert _rel(got, want) < 1e-3


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("vocab", [V, 151936])
def test_linear_cross_entropy_needs_at_most_64_mib_beyond_inputs_and_gradients_at_16k_tokens(vocab, schedule):
    x, w, y = _lce_problem(16384, vocab)
    ops.linear_cross_entropy(x, w, y, schedule=schedule).backward()  # warm-up: compile, cuBLAS workspaces
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ops.linear_cross_entropy(x, w, y, schedule=schedule).backward()
    torch.cuda.synchronize()
    grads = x.grad.numel() * x.grad.element_size() + w.grad.numel() * w.grad.element_size()
    transient = torch.cuda.max_memory_allocated() - base - grads
    assert transient <= 64 * 2**20, f"{transient / 2**20:.1f} MiB"


def test_patched_llama_trains_like_unpatched_on_gpu(train_both):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda()
    ids = torch.randint(0, 1000, (4, 128), device="cuda")
    labels = ids.clone()
    labels[0] = -100
    expected, losses = train_both(model, ids, labels, steps=5, lr=1e-3)
    assert losses == pytest.approx(expected, rel=1e-4)


def _mlp_problem(tokens: int, intermediate: int = 14336):
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [(torch.randn(*s, device="cuda") * 0.02).bfloat16().requires_grad_()
               for s in ((intermediate, H), (intermediate, H), (H, intermediate))]
    return x, weights


def test_tiled_mlp_matches_reference_at_llama3_8b_shapes_with_a_ragged_tile():
    """2 x 8192 tokens in tiles of 3000 (the last 1384) against the fp32 reference on the same bf16 inputs."""
    from lightning_slide.ops.tiled_mlp import tiled_mlp

    x, weights = _mlp_problem(16384)
    xr, wr = _leaf(x, torch.float32), [_leaf(w, torch.float32) for w in weights]
    out = tiled_mlp(x.view(2, 8192, H), *weights, 3000)
    expected = ops.tiled_mlp_reference(xr.view(2, 8192, H), *wr)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout.float())
    assert _rel(out, expected) < BF16_REL and _rel(x.grad, xr.grad) < BF16_REL
    for got, want in zip(weights, wr):
        assert _rel(got.grad, want.grad) < BF16_REL


def test_tiled_mlp_transient_memory_is_three_tiles_whatever_the_length():
    """At 65,536 tokens one untiled gate takes 1.75 GiB; tiled, the forward and backward need three tile buffers
    (`tile_bytes`) beyond the input, its gradient and the weight gradients (and a few MiB of cuBLAS workspace)."""
    from lightning_slide.ops.tiled_mlp import tile_bytes, tile_for, tiled_mlp

    x, weights = _mlp_problem(65536)
    tile = tile_for("auto", 65536, 14336, 2)
    tiled_mlp(x, *weights, tile).sum().backward()  # warm-up: kernels compiled, cuBLAS workspaces made
    x.grad = None
    for w in weights:
        w.grad = None
    dout = torch.randn_like(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tiled_mlp(x, *weights, tile).backward(dout)
    torch.cuda.synchronize()
    kept = x.numel() * 2 + sum(w.numel() * 2 for w in weights)  # x.grad and the weight gradients
    out = x.numel() * 2  # the output, alive until the backward has read it
    transient = torch.cuda.max_memory_allocated() - base - kept - out
    assert transient <= tile_bytes(tile, 14336, 2) + 64 * 2**20, f"{transient / 2**20:.0f} MiB"


@pytest.mark.parametrize("moment", [0, 1], ids=["exp_avg", "exp_avg_sq"])
def test_8bit_codes_compiled_give_the_codecs_bits_over_a_device_updater_chunk(moment):
    """8M elements (the GPU updater's chunk) and a partial block, compiled: no contraction, no flushed subnormal."""
    from lightning_slide.moment_codec import BLOCK, Int8Codec, decode_piece
    from lightning_slide.ops.moment_codes import decode_int8
    from tests.ops.test_moment_codes import _encode, _encode_reference, _moment

    x = _moment(moment, (1 << 23) + 37, "cuda")
    codes, scales = _encode(x, moment)
    expected_codes, expected_scales = _encode_reference(x, moment)
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales.view(torch.int32), expected_scales.view(torch.int32))
    out, expected = torch.empty_like(x), torch.empty_like(x)
    decode_int8(codes, scales, out, moment == 0, Int8Codec(moment).shift, BLOCK)
    decode_piece("int8", codes, scales, expected, expected.view(torch.int32), moment == 0, Int8Codec(moment).shift,
                 BLOCK)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


def test_bf16_rounding_compiled_gives_the_codecs_bits_over_a_device_updater_chunk():
    """8M elements in pieces of 64K (the CPU path's), the noise starting near the table's end."""
    from lightning_slide.moment_codec import NOISE_PERIOD, Bf16Codec, encode_piece
    from lightning_slide.ops.moment_codes import encode_bf16
    from tests.ops.test_moment_codes import _moment

    n, piece, start = (1 << 23) + 37, 1 << 16, NOISE_PERIOD - 300
    x, table = _moment(0, n, "cuda"), Bf16Codec(0).noise.to("cuda")
    values, expected = (torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    encode_bf16(x, values, table, start, NOISE_PERIOD, piece)
    for a in range(0, n, piece):
        part = x[a : a + piece].clone()
        encode_piece("bf16", part, part.view(torch.int32), expected[a : a + piece], None, torch.empty(0), part,
                     part.double(), False, 0, 256, table, (start + a) % NOISE_PERIOD)
    assert torch.equal(values.view(torch.int16), expected.view(torch.int16))


def test_master_planes_compiled_give_the_torch_ops_bits_over_a_device_updater_chunk():
    """8M elements and a partial parity byte, compiled: the weights as torch's CUDA cast rounds them, every non-NaN
    master joined back exactly."""
    from lightning_slide import master_halves
    from lightning_slide.ops.master_halves import join, split
    from tests.ops.test_master_halves import _masters, _planes

    n = (1 << 23) + 13
    master = _masters(n, "cuda")
    planes, expected = _planes(n, "cuda"), _planes(n, "cuda")
    split(master, *planes)
    master_halves.split(master, *expected)
    finite = ~torch.isnan(master)
    assert torch.equal(planes[0].view(torch.int16)[finite], master.to(torch.bfloat16).view(torch.int16)[finite])
    assert torch.equal(planes[1], expected[1]) and torch.equal(planes[2], expected[2])
    joined = join(*planes, torch.empty_like(master))
    assert torch.equal(joined.view(torch.int32)[finite], master.view(torch.int32)[finite])


def _attention_problem(tokens: int, heads: int = 24, kv_heads: int = 8, head_dim: int = 128):
    q = torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    return q, k, v


def test_grouped_attention_matches_sdpa_at_llama3_3b_heads():
    """16,384 causal tokens, 24 query heads over 8 key/value heads, one key/value head a group, against SDPA in
    fp32 (its memory-efficient kernel) on the same bf16 inputs, and against SDPA in bf16 (cuDNN's kernel on an
    H200) to bf16's rounding: each is 0.2% from fp32, and as far from the other."""
    from lightning_slide.ops.grouped_attention import attention_reference, grouped_attention

    q, k, v = _attention_problem(16384)
    dout = torch.randn(1, 24, 16384, 128, device="cuda", dtype=torch.bfloat16)
    got = (grouped_attention(q, k, v, True, None, 1), )
    got += torch.autograd.grad(got[0], (q, k, v), dout)
    ref32 = [_leaf(t, torch.float32) for t in (q, k, v)]
    expanded = [t.repeat_interleave(3, dim=1) for t in ref32[1:]]  # fp32 GQA would take the math kernel: 24 GiB
    want = (attention_reference(ref32[0], *expanded, True), )
    want += torch.autograd.grad(want[0], ref32, dout.float())
    bf16 = (attention_reference(q, k, v, True), )
    bf16 += torch.autograd.grad(bf16[0], (q, k, v), dout)
    for a, b, c in zip(got, want, bf16):
        assert _rel(a, b) < BF16_REL and _rel(a, c) < 5e-3


def test_grouped_attention_s_backward_holds_gibs_less_than_sdpa_s_at_65536_tokens():
    """Llama-3.2-3B's heads at 65,536 tokens: SDPA's backward in one call holds its per-head buffers (flash: 1.5
    GiB of fp32 query accumulator and expanded key/value gradients) for every head; the grouped backward holds
    the gradients and, at a time, about a key/value head's share (its flash buffers, expanded inputs, copies)."""
    from lightning_slide.ops.grouped_attention import attention_reference, group_bytes, grouped_attention

    def backward_peak(attention) -> int:
        q, k, v = _attention_problem(65536)
        out = attention(q, k, v)
        dout = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    grouped = backward_peak(lambda q, k, v: grouped_attention(q, k, v, True, None, 1))
    ungrouped = backward_peak(lambda q, k, v: attention_reference(q, k, v, True))
    assert grouped <= 2.5 * 2**30 * 65536 / 262144 + 2 * group_bytes(65536, 24, 8, 128, 2, 1)
    assert ungrouped - grouped >= 0.5 * 2**30
