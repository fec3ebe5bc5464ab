"""SwiGLU core, silu(gate) * up: forward and backward against the eager expression."""
import pytest
import torch

from lightning_slide.ops import SwiGLUMLP, swiglu, swiglu_reference

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 37), (2, 1501)], ids=["one-block", "masked-tail"])
def test_forward_and_backward_match_reference(shape, dtype, device, assert_matches):
    gate = (2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    gate_r = gate.detach().float().requires_grad_()
    up_r = up.detach().float().requires_grad_()
    grad = torch.randn(shape, device=device).to(dtype)

    out = swiglu(gate, up)
    expected = swiglu_reference(gate_r, up_r)
    assert out.dtype == dtype
    assert_matches(out, expected, dtype)

    out.backward(grad)
    expected.backward(grad.float())
    assert_matches(gate.grad, gate_r.grad, dtype)
    assert_matches(up.grad, up_r.grad, dtype)


# the interpreter computes exp(90) = inf, correctly, and numpy warns about it
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_large_negative_and_positive_gates_stay_finite(device):
    gate = torch.tensor([-90.0, -20.0, 0.0, 20.0, 90.0], device=device, requires_grad=True)
    up = torch.ones(5, device=device, requires_grad=True)
    out = swiglu(gate, up)
    out.sum().backward()
    expected = swiglu_reference(gate.detach(), up.detach())
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()


def test_mlp_matches_hf_llama_mlp(device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4, hidden_act="silu")
    hf = LlamaMLP(cfg).to(device)
    ours = SwiGLUMLP(24, 40).to(device)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 24, device=device)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
