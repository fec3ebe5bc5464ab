"""Bad choices fail early with a message that says what to change; a dying worker stops training."""

import time

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import lightning_slide.layer_adam as layer_adam
from lightning_slide import SlideConfig, SlideEngine, SlidePrecision, SlideStrategy
from lightning_slide.threads import WorkerError
from tests.runtime.helpers import CausalLM, tiny_model, token_batches, trainer


def _fit(module, strategy="slideformer", **kwargs):
    trainer(strategy, 2, **kwargs).fit(module, DataLoader(token_batches(4), batch_size=None))


@pytest.mark.parametrize("precision", ["fp32", "int8"], ids=["optimizer-thread", "compact-pool-thread"])
def test_a_failing_optimizer_thread_stops_fit_with_its_error(precision, monkeypatch, deadline):
    """With compact moments the update runs on the pool's threads: their error reaches the loop the same way."""
    def broken(*args, **kwargs):
        raise FloatingPointError("injected failure in the CPU update")

    monkeypatch.setattr(layer_adam, "adam_", broken)
    start = time.perf_counter()
    with pytest.raises(WorkerError, match="injected failure"):
        _fit(CausalLM(tiny_model()), SlideStrategy(moment_precision=precision))
    assert time.perf_counter() - start < 30


def test_sgd_is_rejected_with_the_alternative():
    with pytest.raises(TypeError, match="torch.optim.AdamW"):
        _fit(CausalLM(tiny_model(), optimizer=torch.optim.SGD))


def test_two_optimizers_are_rejected():
    class Two(CausalLM):
        automatic_optimization = False

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.model.model.parameters()),
                    torch.optim.AdamW(self.model.lm_head.parameters())]

    with pytest.raises(ValueError, match="exactly one optimizer"):
        _fit(Two(tiny_model()))


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precisions_name_the_supported_ones(precision):
    with pytest.raises(ValueError, match="bf16-mixed"):
        _fit(CausalLM(tiny_model()), precision=precision)


def test_fp16_mixed_is_rejected_because_steps_cannot_be_skipped():
    with pytest.raises(ValueError, match="loss scaling"):
        SlidePrecision.adopt(MixedPrecision("16-mixed", "cuda"))


def test_value_clipping_is_rejected_in_favour_of_norm_clipping():
    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        _fit(CausalLM(tiny_model()), clip=1.0, gradient_clip_algorithm="value")


def test_a_model_without_decoder_blocks_is_rejected_with_the_expected_layout():
    class NotAnLM(CausalLM):
        def __init__(self):
            super().__init__(torch.nn.Linear(4, 4))

    with pytest.raises(TypeError, match="No Hugging Face causal LM"):
        _fit(NotAnLM())


def test_parameters_outside_the_language_model_are_rejected():
    module = CausalLM(tiny_model())
    module.extra = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match="outside the causal LM"):
        _fit(module)


def test_compiled_models_are_rejected():
    module = CausalLM(torch.compile(tiny_model()))
    with pytest.raises(ValueError, match="torch.compile"):
        _fit(module)


@pytest.mark.parametrize(
    "settings, message",
    [(dict(slots=1), "at least 2 GPU slots"), (dict(offload="tape"), "offload"), (dict(window=3), "Unknown"),
     (dict(loss_chunk_mib=0), "at least 1 MiB"), (dict(resident_moments=-1), "resident_moments=-1"),
     (dict(resident_moments=2, moment_precision="int8"), "moment_precision='fp32' only")],
)
def test_bad_settings_say_what_is_valid(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SlideStrategy(**settings)


def test_settings_round_trip_through_the_config():
    assert SlideStrategy(slots=4, activations="cpu").config == SlideConfig(slots=4, activations="cpu")


def test_running_out_of_gpu_memory_in_a_step_says_what_to_change():
    class Oom(CausalLM):
        def training_step(self, batch, batch_idx):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    with pytest.raises(torch.OutOfMemoryError, match="(?s)Tried to allocate 2.00 GiB.*recompute='always'.*"
                                                     "expandable_segments:True"):
        trainer("slideformer", 1).fit(Oom(tiny_model()), DataLoader(token_batches(1), batch_size=None))


class TogglesTheEmbedding(CausalLM):
    """Gradual unfreezing (or freezing) in the middle of a run."""

    def __init__(self, model: torch.nn.Module, trains: bool) -> None:
        super().__init__(model)
        self.trains = trains

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())  # frozen parameters included, as torch allows

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.model.model.embed_tokens.weight.requires_grad_(self.trains)


@pytest.mark.parametrize("trains", [True, False], ids=["unfreeze", "freeze"])
def test_changing_which_parameters_train_during_fit_is_refused_by_name(trains):
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(not trains)
    with pytest.raises(RuntimeError, match="changed requires_grad since .*model.embed_tokens.weight"):
        _fit(TogglesTheEmbedding(model, trains))


def test_accumulation_that_starts_unannounced_during_fit_is_refused():
    from lightning.pytorch import Callback

    class AccumulateFromTheSecondEpoch(Callback):  # what GradientAccumulationScheduler does, unrecognised
        def on_train_epoch_start(self, trainer, module):
            trainer.accumulate_grad_batches = 1 if trainer.current_epoch == 0 else 2

    with pytest.raises(RuntimeError, match="gradient accumulation must be known when fit starts"):
        trainer("slideformer", -1, max_epochs=2, callbacks=[AccumulateFromTheSecondEpoch()]).fit(
            CausalLM(tiny_model()), DataLoader(token_batches(4), batch_size=None))



def test_a_setup_that_fails_part_of_the_way_leaves_no_thread_folder_or_patched_module_behind(tmp_path, monkeypatch):
    """The engine has started its optimizer thread, made the disk tier's folder and patched the MLPs when the copy
    thread's setup fails: the error comes out, and nothing of the setup outlives it."""
    import threading

    import lightning_slide.engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in setup")

    monkeypatch.setattr(engine_module, "GradPump", broken)
    model = tiny_model("llama")
    forwards = {name: (type(m), m.forward) for name, m in model.named_modules()}
    config = SlideConfig(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, mlp_tile_tokens=8)
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="injected failure in setup"):
        SlideEngine(model, torch.optim.AdamW(model.parameters()), config, torch.device("cpu"), torch.float32)
    assert set(threading.enumerate()) <= threads
    assert list(tmp_path.iterdir()) == []
    assert {name: (type(m), m.forward) for name, m in model.named_modules()} == forwards
