"""ops.patch on tiny Hugging Face models: same losses and gradients, undoable, runtime-friendly."""
import copy

import pytest
import torch
from torch import nn

from lightning_slide import ops
from lightning_slide.ops import LinearCrossEntropyHead


def _tiny(family: str, tie: bool = True) -> nn.Module:
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    config = getattr(transformers, f"{names}Config")(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        tie_word_embeddings=tie, hidden_act="silu")
    return getattr(transformers, f"{names}ForCausalLM")(config).float().eval()


def _batch(device):
    ids = torch.randint(0, 61, (2, 5), device=device)
    labels = ids.clone()
    labels[0, :2] = -100
    labels[1, :] = -100  # a sequence with every label ignored
    return ids, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_patched_model_gives_the_same_loss_and_gradients(family, device):
    model = _tiny(family).to(device)
    ids, labels = _batch(device)
    expected, want = _loss_and_grads(copy.deepcopy(model), ids, labels)  # before patching: HF's RoPE
    handle = ops.patch(model)
    assert all(handle.counts.values()), handle.counts
    loss, got = _loss_and_grads(model, ids, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    handle.unpatch()


def test_patched_model_trains_to_the_same_losses(device, train_both):
    ids, labels = _batch(device)
    expected, losses = train_both(_tiny("llama").to(device), ids, labels, steps=3, lr=1e-2)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]


def test_with_labels_the_loss_comes_from_inside_the_head_call_and_no_logits_exist(device):
    model = _tiny("llama").to(device)
    handle = ops.patch(model)
    calls = []
    model.lm_head.register_forward_hook(lambda mod, args, kwargs, out: calls.append(kwargs), with_kwargs=True)
    ids, labels = _batch(device)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and out.loss.dim() == 0
    assert calls and calls[0]["labels"] is labels
    handle.unpatch()


def test_without_labels_logits_are_unchanged(device):
    model = _tiny("qwen2").to(device)
    ids, _ = _batch(device)
    expected = model(input_ids=ids).logits
    with ops.patch(model):
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_num_items_in_batch_is_honoured_like_hf(device):
    model = _tiny("llama").to(device)
    ids, labels = _batch(device)
    n = torch.tensor(11, device=device)
    expected = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    with ops.patch(model):
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    torch.testing.assert_close(loss, expected)


def test_tied_head_keeps_the_embedding_parameter(device):
    model = _tiny("llama", tie=True).to(device)
    weight = model.lm_head.weight
    with ops.patch(model):
        assert isinstance(model.lm_head, LinearCrossEntropyHead)
        assert model.lm_head.weight is weight is model.model.embed_tokens.weight


def test_unpatch_restores_classes_forward_and_rotary_function():
    import transformers.models.llama.modeling_llama as modeling

    model = _tiny("llama")
    classes = {name: type(m) for name, m in model.named_modules()}
    rotary = modeling.apply_rotary_pos_emb
    handle = ops.patch(model)
    assert modeling.apply_rotary_pos_emb is ops.apply_rotary_pos_emb
    assert "forward" in model.__dict__
    ops.unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert modeling.apply_rotary_pos_emb is rotary
    assert "forward" not in model.__dict__
    assert handle.counts["rms_norm"] == 3 and handle.counts["swiglu"] == 1


def test_rotary_function_stays_patched_until_the_last_model_is_unpatched():
    import transformers.models.llama.modeling_llama as modeling

    rotary = modeling.apply_rotary_pos_emb
    first, second = ops.patch(_tiny("llama")), ops.patch(_tiny("llama"))
    first.unpatch()
    assert modeling.apply_rotary_pos_emb is ops.apply_rotary_pos_emb
    second.unpatch()
    assert modeling.apply_rotary_pos_emb is rotary


def test_patching_twice_is_refused_and_unsupported_models_are_named():
    model = _tiny("mistral")
    with ops.patch(model), pytest.raises(RuntimeError, match="already patched"):
        ops.patch(model)
    with pytest.raises(ValueError, match="supports"):
        ops.patch(nn.Sequential(nn.Linear(2, 2)))


def test_parameters_are_read_only_inside_their_own_module_call(device):
    """The runtime streams each module's parameters in only for that module's own forward."""
    model = _tiny("qwen3").to(device)
    ids, labels = _batch(device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss
    ops.patch(model)
    real = {}

    def owned(module):
        return [name for name, p in module._parameters.items() if p is not None]

    def swap_in(module, args):
        for name in owned(module):
            module._parameters[name] = real[(module, name)]

    def swap_out(module, args, output):
        for name in owned(module):
            module._parameters[name] = nn.Parameter(torch.full_like(real[(module, name)], float("nan")))

    for module in model.modules():
        if owned(module):
            for name in owned(module):
                real[(module, name)] = module._parameters[name]
            swap_out(module, None, None)
            module.register_forward_pre_hook(swap_in)
            module.register_forward_hook(swap_out)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss
    ops.unpatch(model)
    torch.testing.assert_close(loss, expected)


def test_cpu_without_interpreter_trains_with_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = _tiny("qwen3")
    ids, labels = _batch(torch.device("cpu"))
    expected, want = _loss_and_grads(copy.deepcopy(model), ids, labels)
    with ops.patch(model):
        loss, got = _loss_and_grads(model, ids, labels)
    torch.testing.assert_close(loss, expected)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
