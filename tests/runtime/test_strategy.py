"""The strategy behaves like Lightning's own: names, precision flags, validation, manual optimization, teardown."""

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_slide import SlidePrecision, SlideStrategy
from tests.runtime.helpers import (
    CausalLM,
    EmbedsOutside,
    SkipsBatches,
    fit,
    param_groups,
    reference,
    relative_difference,
    tiny_model,
    token_batches,
    trainer,
)


def test_strategy_name_and_precision_flag_are_honoured():
    t = Trainer(strategy="SlideFormer", precision="bf16-mixed", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SlideStrategy)
    assert isinstance(t.strategy.precision_plugin, SlidePrecision)
    assert t.precision == "bf16-mixed"


def test_validate_without_fit_matches_the_plain_model():
    model, batches = tiny_model("qwen3"), token_batches(3)
    expected = torch.stack([model(input_ids=x, labels=x).loss for x in batches]).mean()
    module = CausalLM(copy.deepcopy(model))
    (result,) = trainer("slideformer", 1).validate(module, DataLoader(batches, batch_size=None), verbose=False)
    assert abs(result["val_loss"] - float(expected)) < 1e-5


def test_validation_inside_fit_sees_the_updated_weights():
    model, batches = tiny_model("llama"), token_batches(4)
    module = CausalLM(copy.deepcopy(model))
    t = trainer("slideformer", 4, val_check_interval=2, check_val_every_n_epoch=None)
    t.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches[:2], batch_size=None))
    trained = reference(model, batches, 4)
    expected = torch.stack([trained(input_ids=x, labels=x).loss for x in batches[:2]]).mean()
    assert abs(float(t.callback_metrics["val_loss"]) - float(expected)) < 1e-5


class ManualStep(CausalLM):
    """Manual optimization: backward first, the step afterwards (the engine defers the update)."""

    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()


def test_manual_optimization_matches_adamw():
    model, batches = tiny_model("mistral"), token_batches(4)
    module = ManualStep(copy.deepcopy(model))
    trainer("slideformer", 4).fit(module, DataLoader(batches, batch_size=None))
    assert relative_difference(reference(model, batches, 4), module.model) <= 1e-6


def _lightning_and_ours(make: Callable[[], CausalLM], batches: list, steps: int, val_batches: list | None = None,
                        **settings) -> list[CausalLM]:
    """The same module trained (and validated on `val_batches`) by Lightning's own strategy, then by slideformer."""
    runs = []
    for strategy in ("auto", "slideformer"):
        runs.append(make())
        val = DataLoader(val_batches, batch_size=None) if val_batches else None
        trainer(strategy, steps, **settings).fit(runs[-1], DataLoader(batches, batch_size=None), val)
    return runs


class ManualVariants(CausalLM):
    """Manual optimization with a backward every `backward_every` batches (step() runs on every batch, a no-op
    for torch's AdamW without one) and, given `clip`, clip_gradients between the backward and the step."""

    automatic_optimization = False

    def __init__(self, model: torch.nn.Module, backward_every: int = 1, clip: str | None = None) -> None:
        super().__init__(model)
        self.backward_every, self.clip = backward_every, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if batch_idx % self.backward_every == 0:
            self.manual_backward(self.model(input_ids=batch, labels=batch).loss)
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm=self.clip)
        opt.step()
        opt.zero_grad()


def test_clip_gradients_in_manual_optimization_clips_that_step_as_with_lightning():
    model = tiny_model("llama")
    lightning, ours = _lightning_and_ours(lambda: ManualVariants(copy.deepcopy(model), clip="norm"),
                                          token_batches(3), 3)
    assert relative_difference(lightning.model, ours.model) <= 1e-6


class ClipsItself(CausalLM):
    """Clips at 0.05 where the Trainer sets no clipping, else as the Trainer says (an override that logs, say)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val or 0.05, gradient_clip_algorithm or "norm")


@pytest.mark.parametrize("clip", [None, 1.0], ids=["without-gradient-clip-val", "with-it"])
def test_a_configure_gradient_clipping_override_is_said_to_be_unused_naming_gradient_clip_val(clip):
    with pytest.warns(UserWarning, match="configure_gradient_clipping override is not used.*gradient_clip_val"):
        trainer("slideformer", 1, clip=clip).fit(ClipsItself(tiny_model("llama")),
                                                 DataLoader(token_batches(1), batch_size=None))


def test_clipping_by_value_in_manual_optimization_is_refused():
    with pytest.raises(ValueError, match="global gradient norm only"):
        trainer("slideformer", 1).fit(ManualVariants(tiny_model(), clip="value"),
                                      DataLoader(token_batches(1), batch_size=None))


def test_a_manual_step_without_a_backward_changes_nothing_as_with_lightning():
    model = tiny_model("llama")
    lightning, ours = _lightning_and_ours(lambda: ManualVariants(copy.deepcopy(model), backward_every=2),
                                          token_batches(4), 4)
    assert relative_difference(lightning.model, ours.model) <= 1e-6


@pytest.mark.parametrize(
    "skip, window",
    [({1}, dict()), ({1, 2}, dict(clip=0.5)), ({3}, dict(accumulate=2, clip=0.5)), ({2}, dict(accumulate=2))],
    ids=["one-step", "two-steps-clipped", "last-of-a-window", "first-of-a-window"],
)
def test_a_batch_whose_training_step_returns_none_is_skipped_as_lightning_skips_it(skip, window):
    """Lightning's own loop is the reference: no backward for the batch; the optimizer steps on what the
    window's other micro-batches accumulated, and not at all when there is none."""
    model = tiny_model("llama")
    lightning, ours = _lightning_and_ours(lambda: SkipsBatches(copy.deepcopy(model), skip), token_batches(8), 3,
                                          **window)
    assert relative_difference(lightning.model, ours.model) <= 1e-6


class Detached(CausalLM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return torch.ones((), requires_grad=True)


def test_a_loss_that_reaches_no_parameter_changes_nothing_as_with_lightning():
    model = tiny_model("llama")
    module = Detached(copy.deepcopy(model))
    trainer("slideformer", 2).fit(module, DataLoader(token_batches(2), batch_size=None))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), module.model.parameters()))


@pytest.mark.parametrize("window", [dict(), dict(clip=0.5), dict(accumulate=2)],
                         ids=["eager", "clipped", "accumulated"])
def test_a_unit_without_a_gradient_is_left_as_adamw_leaves_it(window):
    model = tiny_model("llama")
    lightning, ours = _lightning_and_ours(lambda: EmbedsOutside(copy.deepcopy(model)), token_batches(6), 3, **window)
    assert relative_difference(lightning.model, ours.model) <= 1e-6
    assert torch.equal(ours.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


class EmbedsOutsideEveryOtherBatch(CausalLM):
    """Odd batches feed inputs_embeds made without the model's embedding: in a window of two, the embedding's
    gradient comes from the first micro-batch only."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx % 2 == 0:
            return super().training_step(batch, batch_idx)
        g = torch.Generator().manual_seed(batch_idx)
        embeds = torch.randn(*batch.shape, self.model.config.hidden_size, generator=g)
        return self.model(inputs_embeds=embeds, labels=batch).loss


def test_a_clipped_window_measures_the_sums_of_units_its_last_micro_batch_did_not_reach():
    model = tiny_model("llama")
    lightning, ours = _lightning_and_ours(lambda: EmbedsOutsideEveryOtherBatch(copy.deepcopy(model)),
                                          token_batches(6), 3, accumulate=2, clip=0.05)
    assert relative_difference(lightning.model, ours.model) <= 1e-6


class Generates(CausalLM):
    """Greedy samples with a KV cache from inside validation, as a run that prints samples does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.samples: list[torch.Tensor] = []

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.samples.append(self.model.generate(batch[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0).cpu())


def test_generate_with_a_kv_cache_inside_validation_matches_lightning():
    model, batches = tiny_model("llama"), token_batches(3)
    lightning, ours = _lightning_and_ours(lambda: Generates(copy.deepcopy(model)), batches, 2, batches[:1],
                                         val_check_interval=1)
    assert len(ours.samples) == 2 and all(torch.equal(a, b) for a, b in zip(lightning.samples, ours.samples))


class Evaluates(CausalLM):
    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.model(input_ids=batch, labels=batch).loss)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch).logits.argmax(-1)


def test_test_and_predict_after_fit_see_the_trained_weights_as_lightning_does():
    model, batches = tiny_model("llama"), token_batches(3)
    results = []
    for strategy in ("auto", "slideformer"):
        module, run = Evaluates(copy.deepcopy(model)), trainer(strategy, 2)
        run.fit(module, DataLoader(batches, batch_size=None))
        results.append((run.test(module, DataLoader(batches, batch_size=None))[0]["test_loss"],
                        run.predict(module, DataLoader(batches, batch_size=None))))
    (loss, predicted), (our_loss, our_predicted) = results
    assert our_loss == pytest.approx(loss, rel=1e-5)
    assert all(torch.equal(p, q) for p, q in zip(predicted, our_predicted))


def test_a_model_loaded_in_bf16_trains_from_an_fp32_master_and_comes_back_in_fp32():
    model, batches = tiny_model("llama").to(torch.bfloat16), token_batches(3)
    loaded, upcast = CausalLM(copy.deepcopy(model)), CausalLM(copy.deepcopy(model).float())
    for module in (loaded, upcast):
        trainer("slideformer", 3, precision="bf16-mixed").fit(module, DataLoader(batches, batch_size=None))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(loaded.model.parameters(), upcast.model.parameters()))


def test_after_fit_the_model_is_an_ordinary_cpu_module_again():
    model, batches = tiny_model("qwen2-tied"), token_batches(2)
    module = CausalLM(copy.deepcopy(model))
    trainer("slideformer", 2).fit(module, DataLoader(batches, batch_size=None))
    assert all("forward" not in m.__dict__ for m in module.modules())
    twin = copy.deepcopy(model)
    twin.load_state_dict(module.model.state_dict())
    x = batches[0]
    torch.testing.assert_close(module.model(input_ids=x).logits, twin(input_ids=x).logits, rtol=0, atol=0)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


def test_a_callbacks_state_read_and_load_of_the_module_mid_fit_synchronize_once_and_reload_the_window_once(
        monkeypatch):
    from lightning.pytorch.callbacks import Callback

    from lightning_slide import SlideEngine

    calls = []
    for name in ("synchronize", "master_changed"):
        monkeypatch.setattr(SlideEngine, name, _counted(getattr(SlideEngine, name), name, calls))

    class ReloadsTheModule(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            calls.clear()
            pl_module.load_state_dict(pl_module.state_dict())
            seen.append(list(calls))

    seen = []
    fit(tiny_model("llama"), token_batches(2), "slideformer", 2, callbacks=[ReloadsTheModule()])
    # the read; the load: before, after (which reloads the window from the synchronized masters)
    assert seen == [["synchronize", "synchronize", "master_changed", "synchronize"]] * 2


def _counted(method, name: str, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(name)
        return method(self, *args, **kwargs)
    return counted


def test_lr_schedulers_see_the_optimizer_step():
    module, batches = CausalLM(tiny_model()), token_batches(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer("slideformer", 3).fit(module, DataLoader(batches, batch_size=None))
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert module.lr_schedulers().last_epoch == 3


def test_param_groups_keep_their_own_hyperparameters():
    module = CausalLM(tiny_model())
    trainer("slideformer", 1).fit(module, DataLoader(token_batches(1), batch_size=None))
    groups = module.optimizers().optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [p["weight_decay"] for p in param_groups(module.model)]
