"""Model adapters: cut a Hugging Face causal LM into units (embedding, each decoder block, final norm + head).

A unit is what slides through the GPU as one piece. Each unit is made of *parts*: modules whose forward
calls the engine intercepts (the head unit has two: the final norm and the lm_head, called at different
places by the HF code). Parameters are owned by the first unit that uses them, so a tied lm_head weight
belongs to the embedding unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitSpec:
    name: str
    parts: tuple[nn.Module, ...]
    dedicated: bool  # vocabulary-sized units get their own GPU slot instead of sizing every slot to them


class UnsupportedModelError(TypeError):
    pass


def causal_lm_units(model: nn.Module) -> list[UnitSpec]:
    """Units of an HF causal LM whose decoder blocks sit in one `nn.ModuleList` at `<base>.layers`."""
    base = _decoder(model)
    blocks = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(blocks, nn.ModuleList) or norm is None or embed is None or head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a supported causal LM: expected decoder blocks in an nn.ModuleList at "
            "`model.model.layers`, a final norm at `model.model.norm`, and input/output embeddings "
            "(Llama, Qwen2, Qwen3 and Mistral have this layout)."
        )
    return [
        UnitSpec("embed", (embed,), dedicated=True),
        *(UnitSpec(f"block.{i}", (block,), dedicated=False) for i, block in enumerate(blocks)),
        UnitSpec("head", (norm, head), dedicated=True),
    ]


def find_causal_lm(root: nn.Module) -> nn.Module:
    """The HF causal LM inside a LightningModule (or the module itself)."""
    for module in root.modules():
        if hasattr(module, "get_output_embeddings") and hasattr(module, "get_decoder"):
            return module
    raise UnsupportedModelError(
        f"No Hugging Face causal LM found inside {type(root).__name__}: the slideformer strategy trains a "
        "transformers `*ForCausalLM` model held as a submodule of your LightningModule (e.g. `self.model`)."
    )


def _decoder(model: nn.Module) -> nn.Module:
    try:
        return model.get_decoder()
    except (AttributeError, NotImplementedError):
        return getattr(model, "model", model)
