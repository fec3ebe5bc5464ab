"""Attention over groups of key/value heads: SDPA's outputs and gradients, and where it is used."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_slide import ops
from lightning_slide.ops import grouped_attention as ga


def _qkv(heads: int, kv_heads: int, tokens: int = 37, head_dim: int = 16, batch: int = 2):
    q = torch.randn(batch, heads, tokens, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, tokens, head_dim, requires_grad=True) for _ in range(2))
    return q, k, v


def _run(attention, q, k, v, grad):
    out = attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads,group", [(6, 2, 1), (8, 4, 3), (8, 2, 2), (4, 4, 1)],
                         ids=["gqa3-group1", "gqa2-ragged-group3", "gqa4-one-group", "mha"])
def test_grouped_attention_gives_sdpa_s_outputs_and_gradients(heads, kv_heads, group, is_causal):
    q, k, v = _qkv(heads, kv_heads)
    grad = torch.randn(2, heads, 37, 16)
    scale = 0.3
    got = _run(lambda *t: ga.grouped_attention(*t, is_causal, scale, group), q, k, v, grad)
    want = _run(lambda *t: ga.attention_reference(*t, is_causal, scale), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_output_is_laid_out_as_the_flash_kernels_write_it():
    q, k, v = _qkv(6, 2)
    out = ga.grouped_attention(q, k, v, True, None, 1)
    assert out.transpose(1, 2).is_contiguous()


def test_the_mode_groups_only_calls_it_computes():
    q, k, v = _qkv(6, 2)
    mask = torch.ones(37, 37, dtype=torch.bool).tril()
    with ga.GroupedSDPA(1):
        grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        with torch.no_grad():
            inference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(grouped.grad_fn).__name__ == "GroupedAttentionBackward"
    assert type(masked.grad_fn).__name__ != "GroupedAttentionBackward" and inference.grad_fn is None
    torch.testing.assert_close(masked, ga.attention_reference(q, k, v, True), rtol=1e-5, atol=1e-6)


def test_long_attention_is_grouped_in_whole_kv_heads_within_the_group_budget():
    # Llama-3.2-3B (24 query heads, 8 key/value heads, head_dim 128) and Llama-3.1-8B (32 / 8) in bf16
    assert ga.kv_heads_per_group(8192, 24, 8, 128, 2) is None
    assert ga.kv_heads_per_group(32768, 32, 8, 128, 2) is None  # 1 GiB of buffers: one call
    assert ga.kv_heads_per_group(262144, 24, 8, 128, 2) == 1
    assert ga.kv_heads_per_group(131072, 32, 8, 128, 2) == 1
    # multi-head attention of 32 heads (Llama-2-7B's): several heads a group
    group = ga.kv_heads_per_group(98304, 32, 32, 128, 2)
    per_head = ga.backward_bytes_per_head(98304, 128, False, 2)
    assert group == 5 and group * per_head <= ga.GROUP_MIB * 2**20 < (group + 1) * per_head


def test_grouping_leaves_one_group_s_buffers_of_the_ungrouped_backward():
    """At 262,144 tokens of Llama-3.2-3B the flash backward's query accumulator and expanded key/value gradients
    (6 GiB) become one key/value head's share, with its expanded inputs and query gradient."""
    ungrouped = 24 * ga.backward_bytes_per_head(262144, 128, True, 2)
    assert ungrouped == 6 * 2**30
    assert ga.group_bytes(262144, 24, 8, 128, 2, 1) == 3 * 262144 * 128 * (4 + 4 + 2 * 3)


def _tiny(family: str) -> nn.Module:
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    config = getattr(transformers, f"{names}Config")(
        vocab_size=61, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, hidden_act="silu",
        attn_implementation="sdpa")
    return getattr(transformers, f"{names}ForCausalLM")(config).float()


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_model_whose_long_attention_is_grouped_gives_hf_s_loss_and_gradients(family, monkeypatch):
    monkeypatch.setattr(ga, "UNGROUPED_MIB", 0)  # these 2 x 19 tokens count as long,
    monkeypatch.setattr(ga, "GROUP_MIB", 0)  # and one key/value head fills a group
    model = _tiny(family)
    ids = torch.randint(0, 61, (2, 19))
    expected, want = _loss_and_grads(copy.deepcopy(model), ids)
    calls = []
    apply = ga.GroupedAttention.apply
    monkeypatch.setattr(ga.GroupedAttention, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    with ops.patch(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False,
                   mlp_tile_tokens=None, grouped_attention=True) as handle:
        assert handle.counts["grouped_attention"] == 2
        loss, got = _loss_and_grads(model, ids)
    assert calls == [1, 1]  # both layers, one key/value head a group
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_grouping_is_off_unless_asked_for_and_the_handle_turns_it_on(monkeypatch):
    monkeypatch.setattr(ga, "UNGROUPED_MIB", 0)
    monkeypatch.setattr(ga, "GROUP_MIB", 0)
    model, ids = _tiny("llama"), torch.randint(0, 61, (2, 19))
    calls = []
    apply = ga.GroupedAttention.apply
    monkeypatch.setattr(ga.GroupedAttention, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    with ops.patch(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False,
                   mlp_tile_tokens=None) as handle:
        model(input_ids=ids, labels=ids).loss.backward()
        assert calls == []
        handle.group_attention(True)
        model(input_ids=ids, labels=ids).loss.backward()
        assert calls == [1, 1]
    assert all(type(layer.self_attn).__name__ == "LlamaAttention" for layer in model.model.layers)


def test_short_attention_and_inference_run_hf_s_own_call(monkeypatch):
    model = _tiny("llama")
    calls = []
    monkeypatch.setattr(ga.GroupedAttention, "apply", lambda *a: calls.append(a))
    with ops.patch(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False, mlp_tile_tokens=None,
                   grouped_attention=True):
        model(input_ids=torch.randint(0, 61, (2, 19)), labels=torch.randint(0, 61, (2, 19))).loss.backward()
        monkeypatch.setattr(ga, "UNGROUPED_MIB", 0)
        monkeypatch.setattr(ga, "GROUP_MIB", 0)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 61, (2, 19)))
    assert calls == []
