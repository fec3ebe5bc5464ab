"""The SwiGLU MLP over sequence tiles: the untiled MLP's outputs and gradients, without its tokens x intermediate
tensors, alone and patched into tiny Hugging Face models."""
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_slide import ops
from lightning_slide.ops.tiled_mlp import TILE_MIB, UNTILED_MIB, even_tiles, tile_for, tiled_mlp, tiled_mlp_reference

HIDDEN, INTERMEDIATE = 24, 40


def _weights(device, dtype=torch.float32):
    shapes = [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return [(0.3 * torch.randn(s, device=device)).to(dtype).requires_grad_() for s in shapes]


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _run(fn, x, weights, grad):
    out = fn(x, *weights)
    out.backward(grad)
    return [out.detach(), x.grad, *(w.grad for w in weights)]


@pytest.mark.parametrize("tile", [1, 7, 10, 29, 30, 64], ids=lambda t: f"tile{t}")
def test_tiled_mlp_gives_the_untiled_outputs_and_gradients(tile, device):
    """3 x 10 tokens: tiles of 7 and 29 leave a ragged last tile, 10 divides, 30 and 64 are one tile."""
    x, weights = torch.randn(3, 10, HIDDEN, device=device, requires_grad=True), _weights(device)
    grad = torch.randn(3, 10, HIDDEN, device=device)
    got = _run(lambda x, *w: tiled_mlp(x, *w, tile), x, weights, grad)
    want = _run(tiled_mlp_reference, *_leaves([x]), _leaves(weights), grad)
    for name, a, b in zip(["out", "x", "gate", "up", "down"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_frozen_weights_get_no_gradient_and_the_rest_still_match():
    x, weights = torch.randn(2, 9, HIDDEN, requires_grad=True), _weights("cpu")
    weights[1].requires_grad_(False)
    grad = torch.randn(2, 9, HIDDEN)
    got = _run(lambda x, *w: tiled_mlp(x, *w, 4), x, weights, grad)
    want = _run(tiled_mlp_reference, *_leaves([x]), [weights[0].detach().clone().requires_grad_(), weights[1],
                                                       weights[2].detach().clone().requires_grad_()], grad)
    assert got[3] is None
    for a, b in zip(got[:3] + got[4:], want[:3] + want[4:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.most = max([self.most, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out


def test_no_tokens_by_intermediate_tensor_exists_in_the_forward_or_backward(monkeypatch):
    """40 tokens, hidden 8, intermediate 32, tiles of 8: the largest tensors are the output and its gradient
    (40 x 8) and the weight gradients (32 x 8), never 40 x 32."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the references: each of their steps is an op the mode sees
    x = torch.randn(40, 8, requires_grad=True)
    weights = [torch.randn(s, requires_grad=True) for s in [(32, 8), (32, 8), (8, 32)]]
    with _LargestTensor() as largest:
        tiled_mlp(x, *weights, 8).sum().backward()
    assert largest.most <= max(8 * 32, 40 * 8) < 40 * 32


def test_under_autocast_the_tiles_run_in_the_autocast_dtype_like_the_hf_mlp():
    x, weights = torch.randn(2, 12, HIDDEN, requires_grad=True), _weights("cpu")
    grad = torch.randn(2, 12, HIDDEN, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(lambda x, *w: tiled_mlp(x, *w, 5), x, weights, grad)
        want = _run(tiled_mlp_reference, *_leaves([x]), _leaves(weights), grad)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def test_tile_sizes_follow_the_setting():
    assert tile_for(None, 10**6, 14336, 2) is None
    assert tile_for(512, 512, 14336, 2) is None and tile_for(512, 513, 14336, 2) == 512
    row = 14336 * 2
    untiled = UNTILED_MIB * 2**20 // row
    assert tile_for("auto", untiled, 14336, 2) is None
    for tokens in (untiled + 1, 65536, 131072, 262144):
        tile = tile_for("auto", tokens, 14336, 2)
        tiles = -(-tokens // tile)
        last = tokens - (tiles - 1) * tile
        assert tile * row <= TILE_MIB * 2**20
        assert tile - tiles < last <= tile  # equal tiles, the last at most one token a tile short


def test_even_tiles_split_only_what_one_tile_cannot_hold():
    one = TILE_MIB * 2**20 // (14336 * 2)  # tokens of one tile at intermediate 14336 in bf16
    assert even_tiles(one, 14336, 2) is None
    assert even_tiles(one + 1, 14336, 2) == -(-(one + 1) // 2)


def test_the_patch_handle_retiles_every_tiled_mlp_and_names_a_bad_setting():
    model = _tiny("llama")
    with ops.patch(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False) as handle:
        mlps = [layer.mlp for layer in model.model.layers]
        assert handle.tiled == mlps and all(m.mlp_tile_tokens == "auto" for m in mlps)
        handle.tile_mlps(4)
        assert all(m.mlp_tile_tokens == 4 for m in mlps)
        with pytest.raises(ValueError, match="mlp_tile_tokens"):
            handle.tile_mlps(0)


@pytest.mark.parametrize("setting", [0, -3, 2.5, "always", True])
def test_a_bad_tile_setting_is_named(setting):
    with pytest.raises(ValueError, match="mlp_tile_tokens"):
        ops.patch(_tiny("llama"), mlp_tile_tokens=setting)


def _tiny(family: str) -> nn.Module:
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    config = getattr(transformers, f"{names}Config")(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, hidden_act="silu")
    return getattr(transformers, f"{names}ForCausalLM")(config).float()


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tile", [3, 8, 11], ids=lambda t: f"tile{t}")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_model_with_tiled_mlps_gives_hf_s_loss_and_gradients(family, tile, device):
    """Two sequences of 11 tokens: tiles of 3 and 8 leave a ragged last tile, 11 splits the batch by row."""
    model = _tiny(family).to(device)
    ids = torch.randint(0, 61, (2, 11), device=device)
    expected, want = _loss_and_grads(copy.deepcopy(model), ids)
    with ops.patch(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False,
                   mlp_tile_tokens=tile) as handle:
        assert handle.counts["tiled_mlp"] == 2
        loss, got = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_tiles_run_inside_the_fused_kernels_patch_and_unpatch_restores_the_hf_class(device):
    model = _tiny("llama").to(device)
    mlp_class = type(model.model.layers[0].mlp)
    ids = torch.randint(0, 61, (2, 11), device=device)
    expected, want = _loss_and_grads(copy.deepcopy(model), ids)
    handle = ops.patch(model, mlp_tile_tokens=4)
    assert type(model.model.layers[0].mlp).__name__ == f"TiledKernel{mlp_class.__name__}"
    loss, got = _loss_and_grads(model, ids)
    handle.unpatch()
    assert type(model.model.layers[0].mlp) is mlp_class and "mlp_tile_tokens" not in vars(model.model.layers[0].mlp)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_an_mlp_whose_projection_is_not_a_plain_linear_stays_untiled():
    """An adapter (PEFT's LoRA layers wrap the projection) computes more than the weight alone says."""

    class Adapted(nn.Linear):
        pass

    model = _tiny("llama")
    old = model.model.layers[0].mlp.gate_proj
    model.model.layers[0].mlp.gate_proj = Adapted(old.in_features, old.out_features, bias=False)
    with ops.patch(model, mlp_tile_tokens=4) as handle:
        assert handle.counts["tiled_mlp"] == 1
        assert not type(model.model.layers[0].mlp).__name__.startswith("Tiled")
