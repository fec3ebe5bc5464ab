"""Long single sequences: attention never builds a sequence x sequence tensor for a causal batch, MLPs run over
tiles, and a sequence that cannot fit is refused before its forward with the longest one that would."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

import lightning_slide.planner as planner
from lightning_slide import SlideStrategy
from tests.runtime.helpers import VOCAB, CausalLM, tiny_model, trainer

LONG = 256  # tokens a row: LONG x LONG elements outnumber every other tensor of the tiny models' step


class _Shapes(TorchDispatchMode):
    """The shapes of every tensor an op returns while the mode is on, with at least `elements` elements."""

    def __init__(self, elements: int) -> None:
        super().__init__()
        self.elements, self.large = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.large += [(str(func), tuple(t.shape)) for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.numel() >= self.elements]
        return out


class MaskedLM(CausalLM):
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss


def _rows(mask: bool) -> list[dict]:
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    return [{**batch, "attention_mask": torch.ones_like(ids)} if mask else batch]


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "all-ones-mask"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_causal_batch_trains_without_any_sequence_by_sequence_tensor(arch, mask, monkeypatch):
    """Unpadded rows, with or without an all-ones attention mask (what tokenizers return): Hugging Face's SDPA
    path passes no mask and is_causal=True, so attention keeps one row of statistics per query; RoPE's tables
    are tokens x head_dim."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' references: each of their steps is an op the mode sees
    with _Shapes(LONG * LONG) as shapes:
        trainer(SlideStrategy(mlp_tile_tokens=64), 1).fit(MaskedLM(tiny_model(arch)),
                                                          DataLoader(_rows(mask), batch_size=None))
    assert shapes.large == []


def test_a_padded_batch_does_build_its_mask():
    """The check above can fail: a padded row needs the 4-D mask, which has LONG x LONG elements a row."""
    model = tiny_model("llama")
    (batch,) = _rows(True)
    batch["attention_mask"][0, :3] = 0
    with _Shapes(LONG * LONG) as shapes:
        model(**batch).loss.backward()
    assert any(shape[-2:] == (LONG, LONG) for _, shape in shapes.large)


def test_a_sequence_that_cannot_fit_is_refused_before_its_forward_with_the_longest_that_fits(monkeypatch):
    """The host has room for the batch plan of 2 x 128 tokens only (the CPU's workspace lives in RAM)."""
    class RamFor128Tokens(Callback):
        def on_train_start(self, trainer, pl_module):  # after setup's static check, before the first batch
            shape, setup = trainer.strategy._planned
            room = trainer.strategy.plan.batch(shape, setup, 2, LONG // 2).total("ram", "pinned")
            monkeypatch.setattr(planner, "host_headroom", lambda: 0)
            monkeypatch.setattr(planner, "available_ram", lambda: room)

    forwards = []
    model = tiny_model("llama")
    model.model.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    fit = trainer("slideformer", 1, callbacks=[RamFor128Tokens()]).fit
    with pytest.raises(planner.PlanError, match="This micro-batch has 2 x 256 tokens; the longest sequence that "
                                                "fits at a micro-batch of 2 is 128 tokens"):
        fit(MaskedLM(model), DataLoader(_rows(False), batch_size=None))
    assert forwards == []


def test_auto_tiling_is_decided_from_the_micro_batchs_plan_and_said_in_the_log(monkeypatch, caplog):
    """"auto" as on CUDA (forced here on the CPU, where nothing bounds the plan): the first micro-batch's plan fits
    untiled, so the strategy sets the patched MLPs untiled and says so beside the plan."""
    import logging

    from lightning_slide.config import SlideConfig
    from tests.runtime.helpers import fit, token_batches

    monkeypatch.setattr(SlideConfig, "mlp_tiling", lambda self, device_type: self.mlp_tile_tokens)
    seen = []

    class Look(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            seen.append({m.mlp_tile_tokens for m in trainer.strategy.engine._kernels.tiled})

    with caplog.at_level(logging.INFO):
        fit(tiny_model("llama"), token_batches(2), SlideStrategy(), 2, callbacks=[Look()])
    assert seen == [{None}, {None}]
    assert any("mlp_tile_tokens='auto': untiled" in r.getMessage() for r in caplog.records)
