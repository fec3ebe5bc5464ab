"""The model registry builds the published architectures, and local pretrained folders load through it."""

import pytest
import torch

from lightning_slide.models import MODELS, build_model, check_context, load_config, model_config, scale_rope

# Parameter counts of the published checkpoints (embeddings counted once when tied).
PUBLISHED_PARAMS = {
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "qwen2_5_7b": 7_615_616_512,
    "qwen3_8b": 8_190_735_360,
    "qwen3_14b": 14_768_307_200,
    "mistral_7b": 7_241_732_096,
    "mistral_small_24b": 23_572_403_200,
}


def small_llama(**overrides):
    return model_config("tiny", num_hidden_layers=2, **overrides)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_model_has_published_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = build_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_every_registered_model_except_tiny_has_a_published_count():
    assert set(MODELS) - {"tiny"} == set(PUBLISHED_PARAMS)


def test_qwen3_uses_head_dim_128_independent_of_hidden_size():
    with torch.device("meta"):
        model = build_model("qwen3_14b")
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == 40 * 128 and attention.k_proj.out_features == 8 * 128


def test_random_build_is_fp32_on_cpu():
    model = build_model("tiny")
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}


def test_unknown_model_name_lists_available_models():
    with pytest.raises(KeyError, match="llama3_8b.*qwen3_14b"):
        build_model("llama9_1t")


def test_pretrained_folder_loads_its_weights(tmp_path):
    saved = build_model(small_llama()).eval()
    saved.save_pretrained(tmp_path)
    loaded = build_model("ignored-when-pretrained", pretrained=tmp_path).eval()
    tokens = torch.randint(0, saved.config.vocab_size, (2, 16))
    torch.testing.assert_close(loaded(tokens).logits, saved(tokens).logits, rtol=0, atol=0)


def test_pretrained_model_comes_back_ready_to_train(tmp_path):
    build_model(small_llama()).save_pretrained(tmp_path)
    assert all(m.training for m in build_model("tiny", pretrained=tmp_path).modules())


def test_missing_pretrained_folder_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.pretrained=.*not a local Hugging Face model folder"):
        build_model("tiny", pretrained=tmp_path / "nowhere")


def test_rope_scaling_of_llama3_raises_its_factor_and_grows_its_positions_by_the_same_ratio():
    base = model_config("llama3_3b")
    scaled = scale_rope(base, {"factor": 64.0})
    assert scaled.max_position_embeddings == 262144 and scaled.rope_parameters["factor"] == 64.0
    rope = scaled.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 8192
    assert base.max_position_embeddings == 131072 and base.rope_parameters["factor"] == 32.0  # a copy


def test_linear_rope_scaling_of_a_model_without_scaling_interpolates_its_positions():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base = small_llama()
    scaled = scale_rope(base, {"rope_type": "linear", "factor": 2.0})
    assert scaled.max_position_embeddings == 2 * base.max_position_embeddings
    positions = torch.arange(8)[None]
    x = torch.zeros(1, 8, base.hidden_size)
    half = LlamaRotaryEmbedding(base)(x, positions // 2)[0][:, ::2]
    torch.testing.assert_close(LlamaRotaryEmbedding(scaled)(x, positions)[0][:, ::2], half)


def test_a_sequence_past_the_positions_is_refused_naming_rope_scaling_with_a_factor_that_fits():
    with pytest.raises(ValueError, match=r"data\.seq_len=262144 exceeds llama3_3b's max_position_embeddings=131072; "
                                         r"set model\.rope_scaling .*\{factor:64\.0\}.*or a shorter data\.seq_len"):
        check_context(model_config("llama3_3b"), 262144, "llama3_3b")
    with pytest.raises(ValueError, match=r"\{rope_type:linear,factor:1\.7\}"):
        check_context(model_config("qwen3_8b"), 65536 + 4096, "qwen3_8b")  # 1.7 x 40960 positions: enough
    check_context(scale_rope(model_config("llama3_3b"), {"factor": 64.0}), 262144, "llama3_3b")


@pytest.mark.parametrize("meta", [False, True], ids=["loaded", "meta"])
def test_a_scaled_config_of_a_pretrained_folder_keeps_its_weights(meta, tmp_path):
    saved = build_model(small_llama())
    saved.save_pretrained(tmp_path)
    scaled = scale_rope(load_config("ignored", tmp_path), {"rope_type": "linear", "factor": 4.0})
    model = build_model(scaled, pretrained=tmp_path, meta=meta)
    assert model.config.max_position_embeddings == 4 * saved.config.max_position_embeddings
    if not meta:
        torch.testing.assert_close(model.state_dict(), saved.state_dict(), rtol=0, atol=0)
