"""CausalLMModule: optimizer groups and schedule, metrics from logits, and training with a fused loss."""

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_slide.lm as lm
from lightning_slide.data import IGNORE_INDEX
from lightning_slide.lm import CausalLMModule, adamw_param_groups
from lightning_slide.models import build_model, model_config


def small_model():
    return build_model(model_config("tiny", num_hidden_layers=2))


def random_batches(n: int, batch: int = 4, seq: int = 24, vocab: int = 258) -> list[dict[str, torch.Tensor]]:
    """Random tokens; some labels masked like a prompt would be."""
    batches = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (batch, seq))
        labels = ids.clone()
        labels[:, : torch.randint(1, seq // 2, ()).item()] = IGNORE_INDEX
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return batches


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_param_groups_exempt_norms_and_biases_from_decay():
    model = build_model(model_config("tiny", num_hidden_layers=2, attention_bias=True))
    decay, no_decay = adamw_param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any("bias" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_optimizer_is_plain_adamw_with_stepwise_warmup_then_cosine():
    module = CausalLMModule(small_model(), lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    trainer(max_steps=20).fit(module, DataLoader(random_batches(20), batch_size=None))
    optimizer = module.optimizers().optimizer
    scheduler = module.lr_schedulers()
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert scheduler.lr_lambdas[0](0) == 0 and scheduler.lr_lambdas[0](4) == pytest.approx(1.0)
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)


@pytest.mark.parametrize("slice_bytes", [lm.VAL_LOGITS_BYTES, 7 * 258 * 4], ids=["whole-batch", "seven-token-slices"])
def test_validation_loss_is_the_models_token_mean_loss_and_ppl_its_exp(slice_bytes, monkeypatch):
    """Also when the head's logits are made a few tokens at a time (they never exist for the whole batch)."""
    monkeypatch.setattr(lm, "VAL_LOGITS_BYTES", slice_bytes)
    model = small_model().eval()
    batch = random_batches(1)[0]
    with torch.no_grad():
        expected = model(**batch).loss.item()
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    kept = targets != IGNORE_INDEX
    expected_acc = (logits.argmax(-1)[kept] == targets[kept]).float().mean().item()
    metrics = trainer().validate(CausalLMModule(model), DataLoader([batch], batch_size=None), verbose=False)[0]
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert metrics["val/acc"] == pytest.approx(expected_acc)


def test_training_logs_loss_lr_and_accuracy():
    module = CausalLMModule(small_model())
    fit = trainer(max_steps=3)
    fit.fit(module, DataLoader(random_batches(3), batch_size=None))
    assert {"train/loss", "lr", "train/acc"} <= set(fit.logged_metrics)


class FusedLossModel(torch.nn.Module):
    """A model whose loss kernel never materialises logits: it returns logits=None whenever labels are given."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, labels=None, **kwargs):
        out = self.inner(labels=labels, **kwargs)
        if labels is not None:
            out.logits = None
        return out


def test_fused_loss_trains_and_still_validates_accuracy(monkeypatch):
    monkeypatch.setattr(lm, "VAL_LOGITS_BYTES", 7 * 258 * 4)  # a model without a decoder to call apart: whole logits
    module = CausalLMModule(FusedLossModel(small_model()))
    fit = trainer(max_steps=2, val_check_interval=2, num_sanity_val_steps=0)
    batches = DataLoader(random_batches(2), batch_size=None)
    fit.fit(module, batches, batches)
    assert "train/acc" not in fit.logged_metrics
    assert 0 <= fit.logged_metrics["val/acc"] <= 1 and "train/loss" in fit.logged_metrics


def test_bad_learning_rate_names_the_setting():
    with pytest.raises(ValueError, match="optim.lr > 0"):
        CausalLMModule(small_model(), lr=0.0)
