"""SlideStrategy(offload="none") is Lightning's plain single-device training: no engine, any optimizer."""

import copy

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_slide import SlidePrecision, SlideStrategy
from lightning_slide.strategy import AtomicCheckpointIO
from tests.runtime.helpers import (
    CausalLM,
    fit,
    reference,
    relative_difference,
    tiny_model,
    token_batches,
    trainer,
)


def plain() -> SlideStrategy:
    return SlideStrategy(offload="none")


def test_offload_none_trains_like_plain_pytorch():
    model, batches = tiny_model("llama"), token_batches(4)
    module = fit(model, batches, plain(), 4)
    assert module.trainer.strategy.engine is None
    assert relative_difference(reference(model, batches, 4), module.model) <= 1e-6


def test_offload_none_accumulates_and_clips_like_plain_pytorch():
    model, batches = tiny_model("qwen2-tied"), token_batches(6)
    module = fit(model, batches, plain(), 3, accumulate=2, clip=0.5)
    assert relative_difference(reference(model, batches, 3, accumulate=2, clip=0.5), module.model) <= 1e-6


def test_offload_none_accepts_any_torch_optimizer():
    model, batches = tiny_model("mistral"), token_batches(4)
    sgd = {"momentum": 0.9, "nesterov": True}
    module = fit(model, batches, plain(), 4, optimizer=torch.optim.SGD, optimizer_kwargs=sgd)
    assert isinstance(module.optimizers().optimizer, torch.optim.SGD)
    expected = reference(model, batches, 4, optimizer=torch.optim.SGD, optimizer_kwargs=sgd)
    assert relative_difference(expected, module.model) <= 1e-6


def test_offload_none_resume_from_checkpoint_equals_an_uninterrupted_run(tmp_path):
    model, batches = tiny_model("qwen2-tied"), token_batches(4)  # 2 steps per epoch

    def run(module, ckpt_path=None, callbacks=()):
        t = trainer(plain(), 6, accumulate=2, clip=1.0, default_root_dir=tmp_path,
                    enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
        t.fit(module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)

    straight = CausalLM(copy.deepcopy(model))
    run(straight, callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed = CausalLM(tiny_model("qwen2-tied", seed=123))  # other weights: everything must come from the file
    run(resumed, ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"))
    assert resumed.trainer.global_step == 6
    assert relative_difference(straight.model, resumed.model) <= 1e-6


def test_offload_none_keeps_lightnings_precision_plugin_and_atomic_checkpoints():
    t = trainer(plain(), 1, precision="bf16-mixed")
    assert type(t.strategy.precision_plugin) is MixedPrecision
    assert not isinstance(t.strategy.precision_plugin, SlidePrecision)
    assert isinstance(t.strategy.checkpoint_io, AtomicCheckpointIO)


def test_offload_none_bf16_mixed_keeps_fp32_weights_and_autocasts():
    seen = []

    class Probe(CausalLM):
        def training_step(self, batch, batch_idx):
            seen.append(self.model.lm_head(self.model.model.embed_tokens(batch)).dtype)
            return super().training_step(batch, batch_idx)

    module = Probe(tiny_model("llama"))
    trainer(plain(), 2, precision="bf16-mixed").fit(module, DataLoader(token_batches(2), batch_size=None))
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_offload_none_bf16_true_trains_bf16_weights():
    module = fit(tiny_model("llama"), token_batches(2), plain(), 2, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert module.trainer.global_step == 2


def test_offload_none_init_module_builds_real_tensors_not_meta_placeholders():
    t = trainer(plain(), 1)
    with t.init_module(empty_init=True):
        model = tiny_model("llama")
    assert all(p.device == torch.device("cpu") for p in model.parameters())


def test_offload_none_refuses_more_than_one_device():
    module = CausalLM(tiny_model("llama"))
    with pytest.raises(ValueError, match="trains on one device"):
        trainer(plain(), 1, devices=2).fit(module, DataLoader(token_batches(1), batch_size=None))
