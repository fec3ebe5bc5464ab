"""Checkpoints hold fp32 masters and torch-format Adam state; resuming continues exactly."""

import copy
import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from tests.runtime.helpers import CausalLM, relative_difference, tiny_model, token_batches, trainer


def _fit(module, batches, steps, root, ckpt_path=None, strategy="slideformer", callbacks=()):
    t = trainer(strategy, steps, accumulate=2, clip=1.0, default_root_dir=root, enable_checkpointing=bool(callbacks),
                callbacks=list(callbacks))
    t.fit(module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return t


def test_resume_from_checkpoint_equals_an_uninterrupted_run(tmp_path):
    model, batches = tiny_model("qwen2-tied"), token_batches(4)  # 2 steps per epoch
    straight = CausalLM(copy.deepcopy(model))
    _fit(straight, batches, 6, tmp_path, callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed = CausalLM(tiny_model("qwen2-tied", seed=123))  # other weights: everything must come from the file
    _fit(resumed, batches, 6, tmp_path, ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"))
    assert relative_difference(straight.model, resumed.model) <= 1e-6


@pytest.mark.parametrize("first, then", [("auto", "slideformer"), ("slideformer", "auto")])
def test_a_run_continues_exactly_under_the_other_strategy_from_its_checkpoint(first, then, tmp_path):
    """Move a run between Lightning's own strategy and slideformer (a bigger GPU, then a smaller one)."""
    model, batches = tiny_model("llama"), token_batches(4)
    straight = CausalLM(copy.deepcopy(model))
    _fit(straight, batches, 6, tmp_path, strategy=first,
         callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed = CausalLM(tiny_model("llama", seed=123))
    _fit(resumed, batches, 6, tmp_path / "then", ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"), strategy=then)
    assert relative_difference(straight.model, resumed.model) <= 1e-6


def test_checkpoint_is_a_plain_lightning_checkpoint_with_torch_adam_state(tmp_path):
    model, batches = tiny_model("llama"), token_batches(4)
    module = CausalLM(copy.deepcopy(model))
    t = _fit(module, batches, 2, tmp_path)
    path = tmp_path / "plain.ckpt"
    t.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["optimizer_states"][0]["state"]
    assert len(state) == len(list(model.parameters()))
    assert all(float(s["step"]) == 2 and s["exp_avg_sq"].abs().sum() > 0 for s in state.values())

    plain = CausalLM(copy.deepcopy(model))  # Lightning's default strategy resumes from it and keeps training
    trainer("auto", 3, accumulate=2, clip=1.0, default_root_dir=tmp_path).fit(
        plain, DataLoader(token_batches(6), batch_size=None), ckpt_path=path
    )
    assert plain.trainer.global_step == 3


def test_model_checkpoint_callback_writes_complete_files_and_no_temporaries(tmp_path):
    module, batches = CausalLM(tiny_model("llama")), token_batches(4)
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    t = trainer("slideformer", 2, default_root_dir=tmp_path, enable_checkpointing=True, callbacks=[callback])
    t.fit(module, DataLoader(batches, batch_size=None))
    files = sorted(os.listdir(tmp_path))
    assert [f for f in files if f.endswith(".ckpt")] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert not [f for f in files if ".tmp" in f]
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    for name, p in module.state_dict().items():
        torch.testing.assert_close(saved[name], p, rtol=0, atol=0)
