"""A PEFT LoRA model trains under the sliding strategy as under Lightning's own: the frozen base weights stay put,
the adapters follow torch's AdamW."""

import pytest
import torch

from tests.runtime.helpers import fit, relative_difference, tiny_model, token_batches

peft = pytest.importorskip("peft")
STEPS = 4


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def test_a_lora_model_trains_exactly_as_under_lightnings_own_strategy():
    model, batches = _lora(tiny_model("llama")), token_batches(STEPS)
    lightning = fit(model, batches, "auto", STEPS)
    ours = fit(model, batches, "slideformer", STEPS)
    assert relative_difference(lightning.model, ours.model) <= 1e-6
    pairs = list(zip(model.named_parameters(), ours.model.parameters()))
    assert all(torch.equal(p, q) for (n, p), q in pairs if "lora_" not in n)
    assert all(not torch.equal(p, q) for (n, p), q in pairs if "lora_B" in n)  # initialised to zero, then trained
