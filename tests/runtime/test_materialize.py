"""A model built on the meta device is filled unit by unit straight into the engine's storage."""

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_slide.materialize import meta_parameters
from lightning_slide.models import build_model
from tests.runtime.helpers import CausalLM, fit, tiny_model, token_batches, trainer


def _meta_copy_of(folder) -> torch.nn.Module:
    model = build_model("unused", pretrained=folder, meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied"])
def test_a_meta_model_filled_from_a_sharded_checkpoint_trains_exactly_like_the_loaded_one(arch, tmp_path):
    tiny_model(arch).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    batches = token_batches(3)
    expected = fit(loaded, batches, "slideformer", 3)
    got = CausalLM(_meta_copy_of(tmp_path))
    trainer("slideformer", 3).fit(got, DataLoader(batches, batch_size=None))
    assert all(torch.equal(a, b) for a, b in zip(expected.model.parameters(), got.model.parameters()))


def test_a_meta_model_without_a_checkpoint_gets_the_models_own_random_init():
    with meta_parameters():
        model = tiny_model("llama")
    module = CausalLM(model)
    trainer("slideformer", 1).fit(module, DataLoader(token_batches(1), batch_size=None))
    std = model.config.initializer_range
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(abs(float(w.std()) - std) < 0.2 * std for w in weights)
    assert torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight), atol=0.05)


def test_init_module_with_empty_init_builds_placeholders_that_the_engine_fills():
    t = trainer("slideformer", 1)
    with t.init_module(empty_init=True):
        model = tiny_model("qwen3")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"  # buffers are real
    t.fit(CausalLM(model), DataLoader(token_batches(1), batch_size=None))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_missing_a_parameter_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        trainer("slideformer", 1).fit(CausalLM(_meta_copy_of(tmp_path)), DataLoader(token_batches(1), batch_size=None))
