"""`Fabric(strategy="slideformer")` trains exactly as Fabric's own single-device strategy with torch's AdamW."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_slide.config import SlideConfig
from lightning_slide.fabric import SlideFabricStrategy
from tests.runtime.helpers import param_groups, relative_difference, tiny_model, token_batches, warmup_decay

STEPS = 4


class Run:
    """One Fabric training loop, written as a Fabric user writes it: AdamW with param groups and a schedule."""

    def __init__(self, model: torch.nn.Module, strategy: Any = "slideformer", precision: str = "32-true",
                 fabric: Fabric | None = None, accelerator: str = "cpu") -> None:
        self.fabric = fabric or Fabric(strategy=strategy, accelerator=accelerator, devices=1, precision=precision)
        optimizer = torch.optim.AdamW(param_groups(model), lr=3e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        self.losses: list[float] = []
        self.norms: list[float] = []  # what fabric.clip_gradients returned

    def train(self, batches: list[torch.Tensor], accumulate: int = 1, clip: float | None = None) -> Run:
        for start in range(0, len(batches), accumulate):
            window = batches[start : start + accumulate]
            for i, x in enumerate(window):
                x = self.fabric.to_device(x)
                with self.fabric.no_backward_sync(self.model, enabled=i < len(window) - 1):
                    loss = self.model(input_ids=x, labels=x).loss
                    self.fabric.backward(loss / accumulate)
                self.losses.append(float(loss.detach()))
            if clip is not None:
                self.norms.append(float(self.fabric.clip_gradients(self.model, self.optimizer, max_norm=clip)))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return self

    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def close(self) -> torch.nn.Module:
        """The trained module (the engine's updates finished and its threads stopped)."""
        self.fabric.strategy.teardown()
        return self.model.module


def trained(model: torch.nn.Module, strategy: Any, batches: list[torch.Tensor], precision: str = "32-true",
            accelerator: str = "cpu", **settings) -> torch.nn.Module:
    run = Run(copy.deepcopy(model), strategy, precision, accelerator=accelerator)
    return run.train(batches, **settings).close()


@pytest.mark.parametrize(
    "arch, strategy, clip",
    [("llama", "slideformer", None), ("qwen2-tied", "slideformer", 0.05), ("llama", "slideformer_nvme", 0.05)],
    ids=["plain", "clip-gradients-by-norm", "disk-tier-clipped"],
)
def test_steps_match_fabrics_single_device_adamw(arch, strategy, clip):
    model, batches = tiny_model(arch), token_batches(STEPS)
    expected = trained(model, "auto", batches, clip=clip)
    got = trained(model, strategy, batches, clip=clip)
    assert relative_difference(expected, got) <= 1e-6


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clip_gradients_returns_the_global_norm_before_clipping_as_fabric_does(accumulate):
    model, batches = tiny_model("llama"), token_batches(STEPS * accumulate)
    expected = Run(copy.deepcopy(model), "auto").train(batches, accumulate=accumulate, clip=0.05)
    got = Run(copy.deepcopy(model), "slideformer").train(batches, accumulate=accumulate, clip=0.05)
    assert len(got.norms) == STEPS and got.norms == pytest.approx(expected.norms, rel=1e-5)
    assert relative_difference(expected.close(), got.close()) <= 1e-6


def test_a_backward_after_clip_gradients_makes_the_step_clip_by_the_norm_of_all_its_gradients():
    """The norm measured by clip_gradients no longer holds once another backward adds to the sums: the step then
    clips as Fabric does when both backwards come before clip_gradients."""
    model, (first, second) = tiny_model("llama"), token_batches(2)
    expected, got = Run(copy.deepcopy(model), "auto"), Run(copy.deepcopy(model), "slideformer")
    for run, clip_after in ((expected, 2), (got, 1)):
        for i, x in enumerate((first, second), start=1):
            run.fabric.backward(run.model(input_ids=x, labels=x).loss)
            if i == clip_after:
                run.fabric.clip_gradients(run.model, run.optimizer, max_norm=0.05)
        run.optimizer.step()
    assert relative_difference(expected.close(), got.close()) <= 1e-6


def test_accumulation_over_two_micro_batches_with_no_backward_sync_matches_fabric():
    model, batches = tiny_model("llama"), token_batches(STEPS * 2)
    expected = trained(model, "auto", batches, accumulate=2, clip=0.5)
    got = trained(model, "slideformer", batches, accumulate=2, clip=0.5)
    assert relative_difference(expected, got) <= 1e-6


def _load_with_fabric(run: Run, path: Path) -> int:
    state = {**run.state(), "step": 0}
    run.fabric.load(path, state)
    return state["step"]


def _load_with_torch(run: Run, path: Path) -> int:
    """What a plain PyTorch loop does: each object's own load_state_dict."""
    checkpoint = torch.load(path, weights_only=True)
    for name, obj in run.state().items():
        obj.load_state_dict(checkpoint[name])
    return checkpoint["step"]


@pytest.mark.parametrize("load", [_load_with_fabric, _load_with_torch], ids=["fabric.load", "load_state_dict"])
def test_save_then_load_into_a_fresh_run_continues_as_the_uninterrupted_run(load, tmp_path):
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = trained(model, "auto", batches)
    first = Run(copy.deepcopy(model)).train(batches[:2])
    first.fabric.save(tmp_path / "run.ckpt", {**first.state(), "step": 2})
    first.close()
    second = Run(tiny_model("llama", seed=7))  # other weights: the load must replace them all
    assert load(second, tmp_path / "run.ckpt") == 2
    got = second.train(batches[2:]).close()
    assert relative_difference(expected, got) <= 1e-6


def test_saved_optimizer_state_is_torchs_adamw_format(tmp_path):
    model, batches = tiny_model("llama"), token_batches(2)
    expected = Run(copy.deepcopy(model), "auto").train(batches)
    got = Run(copy.deepcopy(model)).train(batches)
    for run, name in ((expected, "auto.ckpt"), (got, "slide.ckpt")):
        run.fabric.save(tmp_path / name, {"optimizer": run.optimizer})
        run.close()
    want, have = (torch.load(tmp_path / n, weights_only=True)["optimizer"] for n in ("auto.ckpt", "slide.ckpt"))
    assert have["param_groups"] == want["param_groups"]
    assert have["state"].keys() == want["state"].keys()
    for key, state in want["state"].items():
        assert float(have["state"][key]["step"]) == float(state["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            got, want_moment = have["state"][key][moment], state[moment]  # elementwise, a cancelling gradient
            assert float((got - want_moment).norm() / want_moment.norm()) <= 1e-5  # may differ in its last bits


def test_state_dict_after_a_step_waits_for_the_queued_updates(monkeypatch):
    """The optimizer thread may still be updating when step() returns: state_dict() first waits for it."""
    from lightning_slide.engine import SlideEngine

    waits = []
    synchronize = SlideEngine.synchronize
    monkeypatch.setattr(SlideEngine, "synchronize", lambda self: waits.append(self) or synchronize(self))
    run = Run(tiny_model("llama")).train(token_batches(1))
    waits.clear()
    run.model.state_dict()
    assert waits == [run.fabric.strategy.engine]
    run.close()


def _loss(run: Run, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(run.model(input_ids=x, labels=x).loss)


def test_load_state_dict_reloads_the_weights_the_window_computes_with():
    """Under bf16 the window computes with bf16 copies of the masters: loading new masters refreshes them."""
    x = token_batches(1)[0]
    other = Run(tiny_model("llama", seed=3), precision="bf16-mixed")
    want, weights = _loss(other, x), other.model.state_dict()
    other.close()
    run = Run(tiny_model("llama"), precision="bf16-mixed")
    before = _loss(run, x)
    run.model.load_state_dict(weights)
    assert _loss(run, x) == want != before
    run.close()


def _saved_model(folder: Path) -> torch.nn.Module:
    model = tiny_model("qwen2-tied")
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).train()


def test_init_module_with_empty_init_fills_placeholders_from_the_models_folder(tmp_path):
    """The folder is the config's name_or_path (AutoConfig.from_pretrained sets it): the same weights as loaded."""
    loaded, batches = _saved_model(tmp_path), token_batches(STEPS)
    expected = trained(loaded, "slideformer", batches)
    run_fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    with run_fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    run = Run(model, fabric=run_fabric)
    got = run.train(batches).close()
    assert all(torch.equal(a, b) for a, b in zip(expected.parameters(), got.parameters()))


def test_a_model_built_from_a_config_with_empty_init_trains_and_its_loss_falls():
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    with fabric.init_module(empty_init=True):
        model = tiny_model("llama")
    model.config.name_or_path = ""  # no folder: the model's own initialiser
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    x = token_batches(1)[0]
    losses = []
    for _ in range(6):
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    fabric.strategy.teardown()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.8 * losses[0]


def test_a_model_set_up_without_an_optimizer_evaluates_as_the_plain_model():
    model, x = tiny_model("llama"), token_batches(1)[0]
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    slid = fabric.setup(copy.deepcopy(model))
    with torch.no_grad():
        assert float(slid(input_ids=x, labels=x).loss) == pytest.approx(float(model(input_ids=x, labels=x).loss),
                                                                         rel=1e-6)
    fabric.strategy.teardown()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_computes_from_fp32_masters_and_trains_close_to_fp32(precision):
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = trained(model, "auto", batches)
    got = Run(copy.deepcopy(model), precision=precision).train(batches).close()
    assert {p.dtype for p in got.parameters()} == {torch.float32}  # the masters stay fp32
    assert relative_difference(expected, got, per_tensor_limit=0.1) <= 0.02


@pytest.mark.gpu
def test_fp32_on_cuda_with_accumulation_and_clipping_matches_fabric_on_cuda():
    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS * 2)
    expected = trained(model, "auto", batches, accelerator="cuda", accumulate=2, clip=0.05)
    got = trained(model, SlideFabricStrategy(use_kernels=False), batches, accelerator="cuda", accumulate=2, clip=0.05)
    assert relative_difference(expected, got) <= 1e-5


@pytest.mark.gpu
def test_bf16_mixed_on_cuda_with_the_kernels_trains_close_to_fabrics_bf16_mixed():
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = trained(model, "auto", batches, "bf16-mixed", accelerator="cuda", clip=0.5)
    got = trained(model, "slideformer", batches, "bf16-mixed", accelerator="cuda", clip=0.5)
    assert {(p.device.type, p.dtype) for p in got.parameters()} == {("cpu", torch.float32)}
    assert relative_difference(expected, got, per_tensor_limit=0.1) <= 0.02


# ------------------------------------------------------------------------------------------------ bad input
def test_the_log_says_how_the_first_step_sized_the_window(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        trained(tiny_model("llama"), "slideformer", token_batches(2))
    assert [r.getMessage() for r in caplog.records if "window sized" in r.getMessage()] == [
        "slideformer window sized for micro-batches of up to 32 tokens: 3 of 3 blocks have a GPU slot (0 added, 0.00 "
        "GiB); 0.00 GiB for kept graphs (recompute='auto')"]


def test_two_optimizers_are_refused_with_what_to_do():
    model = tiny_model("llama")
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    first, second = (torch.optim.AdamW(model.parameters()) for _ in range(2))
    with pytest.raises(ValueError, match="exactly one optimizer.*one torch.optim.AdamW"):
        fabric.setup(model, first, second)


def test_more_than_one_device_is_refused():
    model = tiny_model("llama")
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="devices=1"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()))


def test_a_non_adam_optimizer_is_refused():
    model = tiny_model("llama")
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    with pytest.raises((TypeError, ValueError), match="(?i)adam"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_clipping_by_value_is_refused_with_the_norm_alternative():
    run = Run(tiny_model("llama"))
    try:
        with pytest.raises(ValueError, match="max_norm"):
            run.fabric.clip_gradients(run.model, run.optimizer, clip_val=1.0)
    finally:
        run.close()


def test_fp16_precision_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="bf16-mixed"):
        Fabric(strategy="slideformer", accelerator="cpu", devices=1, precision="16-true")


def test_setting_up_the_optimizer_apart_from_the_model_is_refused():
    fabric = Fabric(strategy="slideformer", accelerator="cpu", devices=1)
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="fabric.setup\\(model, optimizer\\)"):
        fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))


def test_the_strategy_takes_a_config_and_keyword_settings_that_win():
    strategy = SlideFabricStrategy(SlideConfig(slots=2, activations="cpu"), activations="device")
    assert (strategy.config.slots, strategy.config.activations) == (2, "device")


def test_an_unknown_setting_is_refused():
    with pytest.raises((TypeError, ValueError), match="slotz"):
        SlideFabricStrategy(slotz=2)
