"""RoPE on q and k: Hugging Face's apply_rotary_pos_emb, forward and backward, GQA, both layouts."""
import pytest
import torch

from lightning_slide.ops import apply_rotary_pos_emb, rope_reference

DTYPES = [torch.float32, torch.bfloat16]


def _cos_sin(batch, seq, head_dim, device, dtype):
    """HF's default rotary table: cos/sin of cat(freqs, freqs), shape [batch, seq, head_dim].

    Each sequence starts at its own position (as with per-sequence position_ids), so a kernel that
    read the wrong batch row of cos/sin would not match.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(seq, device=device).float() + 3 + 5 * torch.arange(batch, device=device)[:, None]
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(batch, seq, hq, hk, head_dim, unsqueeze_dim, dtype, device):
    """q, k as HF makes them: projections viewed [b, s, h, d], transposed when unsqueeze_dim=1."""
    q = torch.randn(batch, seq, hq, head_dim, device=device).to(dtype)
    k = torch.randn(batch, seq, hk, head_dim, device=device).to(dtype)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


def _check(q, k, cos, sin, unsqueeze_dim, dtype, assert_matches):
    """Forward and backward of ours against the reference in fp32 on the same inputs."""
    q_r, k_r = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert "RoPEFunction" in type(q_out.grad_fn).__name__
    q_exp, k_exp = rope_reference(q_r, k_r, cos.float(), sin.float(), unsqueeze_dim)
    assert_matches(q_out, q_exp, dtype)
    assert_matches(k_out, k_exp, dtype)

    gq, gk = torch.randn_like(q_exp).to(q_out.dtype), torch.randn_like(k_exp).to(k_out.dtype)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    torch.autograd.backward((q_exp, k_exp), (gq.float(), gk.float()))
    assert q.grad.dtype == q.dtype and k.grad.dtype == k.dtype
    assert_matches(q.grad, q_r.grad, dtype)
    assert_matches(k.grad, k_r.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("head_dim", [18, 128], ids=["odd-half", "llama-128"])
def test_forward_and_backward_match_reference_with_gqa(head_dim, unsqueeze_dim, dtype, device,
                                                       assert_matches):
    q, k = _qk(2, 3, 6, 2, head_dim, unsqueeze_dim, dtype, device)
    cos, sin = _cos_sin(2, 3, head_dim, device, dtype)
    _check(q, k, cos, sin, unsqueeze_dim, dtype, assert_matches)


@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_several_token_blocks_with_a_remainder_and_odd_head_counts(head_dim, device, assert_matches):
    """5 q heads and 1 kv head: several tokens per program, 39 tokens leave a partial last block."""
    q, k = _qk(3, 13, 5, 1, head_dim, 1, torch.float32, device)
    cos, sin = _cos_sin(3, 13, head_dim, device, torch.float32)
    _check(q, k, cos, sin, 1, torch.float32, assert_matches)


def test_q_and_k_sliced_from_a_fused_projection(device, assert_matches):
    """Heads not dense in memory (a qkv projection split by slicing): any strides but the last."""
    b, s, hq, hk, d = 2, 7, 4, 2, 16
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device)
    q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2).detach().requires_grad_()
    k = qkv[..., hq * d: (hq + hk) * d].view(b, s, hk, d).transpose(1, 2).detach().requires_grad_()
    cos, sin = _cos_sin(b, s, d, device, torch.float32)
    _check(q, k, cos, sin, 1, torch.float32, assert_matches)


def test_bf16_q_with_fp32_cos_promotes_like_hf(device, assert_matches):
    """Under autocast HF's cos/sin are fp32 and q/k bf16: the product is fp32, the grads bf16."""
    q, k = _qk(1, 6, 4, 2, 32, 1, torch.bfloat16, device)
    cos, sin = _cos_sin(1, 6, 32, device, torch.float32)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.float32
    _check(q, k, cos, sin, 1, torch.bfloat16, assert_matches)


def test_outputs_keep_the_input_memory_layout(device):
    q, k = _qk(1, 4, 4, 2, 16, 1, torch.float32, device)
    cos, sin = _cos_sin(1, 4, 16, device, torch.float32)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_cos_sin_shared_across_the_batch_broadcast(device, assert_matches):
    q, k = _qk(3, 4, 2, 1, 16, 1, torch.float32, device)
    cos, sin = _cos_sin(1, 4, 16, device, torch.float32)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    q_exp, k_exp = rope_reference(q, k, cos, sin)
    assert_matches(q_out, q_exp, torch.float32)
    assert_matches(k_out, k_exp, torch.float32)


def test_cpu_without_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k = _qk(1, 3, 2, 1, 8, 1, torch.float32, torch.device("cpu"))
    cos, sin = _cos_sin(1, 3, 8, torch.device("cpu"), torch.float32)
    q_out, _ = apply_rotary_pos_emb(q, k, cos, sin)
    assert "RoPEFunction" not in type(q_out.grad_fn).__name__
