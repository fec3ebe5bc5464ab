"""Sliding training must be plain training: same parameters as a PyTorch loop with torch.optim.AdamW."""

import copy

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lightning_slide import SlideStrategy
from tests.runtime.helpers import (
    ARCHS,
    SEQ,
    VOCAB,
    CausalLM,
    fit,
    param_groups,
    reference,
    relative_difference,
    tiny_model,
    token_batches,
    trainer,
    warmup_decay,
)

STEPS = 5


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp32_matches_adamw_with_accumulation_clipping_and_schedule(arch):
    model, batches = tiny_model(arch), token_batches(STEPS * 2)
    expected = reference(model, batches, STEPS, accumulate=2, clip=0.5)
    got = fit(model, batches, "slideformer", STEPS, accumulate=2, clip=0.5)
    assert relative_difference(expected, got.model) <= 1e-6


@pytest.mark.parametrize("settings", [dict(), dict(chunk_elems=1024, grad_buffers=2)], ids=["default", "small-chunks"])
def test_fp32_matches_adamw_with_clipping_and_one_backward_per_step(settings):
    """Each gradient is its unit's whole sum: it lands in the sums directly and its norm is measured where it was."""
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, clip=0.05)
    got = fit(model, batches, SlideStrategy(**settings), STEPS, clip=0.05)
    assert relative_difference(expected, got.model) <= 1e-6


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_and_accumulation_match_adamw_when_the_sums_could_not_be_pinned(accumulate, monkeypatch):
    """Then a window's first gradient goes through the landing buffers and the optimizer thread copies it in."""
    from lightning_slide.gradients import GradRouter

    monkeypatch.setattr(GradRouter, "_lands_directly", lambda self, pinned: False)
    model, batches = tiny_model("llama"), token_batches(STEPS * accumulate)
    expected = reference(model, batches, STEPS, accumulate=accumulate, clip=0.05)
    got = fit(model, batches, "slideformer", STEPS, accumulate=accumulate, clip=0.05)
    assert relative_difference(expected, got.model) <= 1e-6


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(slots=2), dict(slots="auto"), dict(activations="cpu"), dict(chunk_elems=1024, grad_buffers=2),
     dict(recompute="never"), dict(recompute="never", slots=2), dict(block_grad_buffers=2)],
    ids=["default", "two-slots", "auto-slots", "activations-on-host", "small-chunks", "kept-graphs",
         "kept-graphs-two-slots", "two-gradient-buffers"],
)
def test_fp32_matches_adamw_when_updates_overlap_the_backward(settings):
    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS)
    expected = reference(model, batches, STEPS)
    got = fit(model, batches, SlideStrategy(**settings), STEPS)
    assert relative_difference(expected, got.model) <= 1e-6


def test_fp32_matches_adamw_when_saved_inputs_come_back_only_after_the_backward_before_theirs(monkeypatch):
    """Inputs in RAM of LATE_PREFETCH_BYTES or more (here every one) are copied back after the next-later part's
    backward instead of during it."""
    import lightning_slide.activations as activations
    from lightning_slide.parts import Call

    monkeypatch.setattr(activations, "LATE_PREFETCH_BYTES", 0)
    late = []
    monkeypatch.setattr(Call, "prefetches_late", property(lambda call: late.append(call.part.unit) or True))
    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS)
    expected = reference(model, batches, STEPS)
    got = fit(model, batches, SlideStrategy(activations="cpu"), STEPS)
    assert relative_difference(expected, got.model) <= 1e-6
    assert late and activations.ActivationStore.prefetches_late(1, "cpu")


@pytest.mark.parametrize(
    "settings", [dict(), dict(recompute="never", slots=2)], ids=["recomputed", "kept-graphs-two-slots"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_with_mlps_over_sequence_tiles_matches_lightnings_own_training(arch, settings, monkeypatch):
    """Tiles of 5 tokens over micro-batches of 2 x 16 (the last tile ragged), accumulating two and clipping: the
    tiled MLPs' weight gradients reach the optimizer as the untiled ones do; a kept graph reads the MLP weights
    back from whichever slot holds them at its backward."""
    import lightning_slide.ops.hf_patch as hf_patch
    from lightning_slide.ops.tiled_mlp import tiled_mlp

    calls = []
    monkeypatch.setattr(hf_patch, "tiled_mlp", lambda *args: calls.append(args[-1]) or tiled_mlp(*args))
    model, batches = tiny_model(arch), token_batches(STEPS * 2)
    lightning = fit(model, batches, "auto", STEPS, accumulate=2, clip=0.5)
    ours = fit(model, batches, SlideStrategy(mlp_tile_tokens=5, **settings), STEPS, accumulate=2, clip=0.5)
    assert calls and set(calls) == {5}
    assert relative_difference(lightning.model, ours.model) <= 1e-6


def test_fp32_with_attention_over_groups_of_heads_matches_lightnings_own_training(monkeypatch):
    """Every recomputed attention call over groups of one key/value head (the size thresholds at zero, grouping
    turned on as the planner does for a long micro-batch), clipping: the engine trains as Lightning does."""
    from dataclasses import replace

    import lightning_slide.ops.grouped_attention as grouped
    import lightning_slide.strategy as strategy

    monkeypatch.setattr(grouped, "UNGROUPED_MIB", 0)
    monkeypatch.setattr(grouped, "GROUP_MIB", 0)
    calls, apply = [], grouped.GroupedAttention.apply
    monkeypatch.setattr(grouped.GroupedAttention, "apply", lambda *a: calls.append(a[-1]) or apply(*a))

    resolve = strategy.resolve_batch_setup
    monkeypatch.setattr(strategy, "resolve_batch_setup",  # as the planner decides for a micro-batch that needs it
                        lambda *a: (lambda runs, needs: (replace(runs, grouped_attention=True), needs))(*resolve(*a)))
    model, batches = tiny_model("llama"), token_batches(STEPS)
    lightning = fit(model, batches, "auto", STEPS, clip=0.5)
    assert calls == []
    ours = fit(model, batches, SlideStrategy(mlp_tile_tokens=1024), STEPS, clip=0.5)
    assert calls and set(calls) == {1}
    assert relative_difference(lightning.model, ours.model) <= 1e-6


def test_micro_batches_of_changing_size_match_adamw_and_a_larger_one_sizes_the_window_again():
    """The window grows after the first step for that step's batch; a larger micro-batch later gives the grown
    slots back before its forward (its activations need the memory) and the window grows again after it."""
    model, g = tiny_model("llama", num_hidden_layers=6), torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for rows in (1, 1, 3, 2, 3)]
    expected = reference(model, batches, len(batches))
    strategy, ring = SlideStrategy(slots="auto"), []

    class RingDuringBackward(Callback):
        def on_before_backward(self, trainer, module, loss):
            ring.append(len(strategy.engine.window.ring))

    got = fit(model, batches, strategy, len(batches), callbacks=[RingDuringBackward()])
    assert ring == [3, 6, 3, 6, 6]
    assert relative_difference(expected, got.model) <= 1e-6


def test_the_updates_the_next_forward_waits_for_come_first(monkeypatch):
    """The backward finishes the units last to first; the three lowest blocks (one per gradient buffer) wait
    for the embedding and then go in the order the next forward loads them."""
    import lightning_slide.layer_adam as layer_adam

    order, adam_ = [], layer_adam.adam_
    monkeypatch.setattr(layer_adam, "adam_", lambda storage, *a: (order.append(storage.name), adam_(storage, *a)))
    fit(tiny_model("llama", num_hidden_layers=6), token_batches(1), SlideStrategy(block_grad_buffers=3), 1)
    assert order == ["head", "block.5", "block.4", "block.3", "embed", "block.0", "block.1", "block.2"]


def test_an_epochs_last_partial_accumulation_window_steps_as_lightning_does():
    """Five batches, windows of two, two epochs: each epoch ends with a one-batch window."""
    model, batches = tiny_model("llama"), token_batches(5)
    lightning = fit(model, batches, "auto", -1, accumulate=2, max_epochs=2)
    ours = fit(model, batches, "slideformer", -1, accumulate=2, max_epochs=2)
    assert relative_difference(lightning.model, ours.model) <= 1e-6


class PaddedLM(CausalLM):
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss


def test_left_padded_batches_with_masked_labels_match_adamw():
    """Rows of different lengths padded on the left to one: the attention mask reaches every block (a real
    token would otherwise attend to the pads before it), pads carry no loss."""
    model, g = tiny_model("qwen3"), torch.Generator().manual_seed(5)
    batches = []
    for _ in range(STEPS):
        ids, mask = torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.ones(3, SEQ, dtype=torch.long)
        for row, length in enumerate(torch.randint(SEQ // 2, SEQ + 1, (3,), generator=g).tolist()):
            mask[row, : SEQ - length] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    expected = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(expected), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
    for batch in batches:
        expected(**batch).loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
    ours = PaddedLM(copy.deepcopy(model))
    trainer("slideformer", STEPS).fit(ours, DataLoader(batches, batch_size=None))
    assert relative_difference(expected, ours.model) <= 1e-6


def test_a_gradient_accumulation_scheduler_steps_as_lightning_does():
    """One batch per step in the first epoch, two from the second: the host keeps sums from the start."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model, batches = tiny_model("llama"), token_batches(4)
    runs = [fit(model, batches, strategy, -1, max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])
            for strategy in ("auto", "slideformer")]
    assert relative_difference(runs[0].model, runs[1].model) <= 1e-6


def test_fp32_matches_adamw_with_accumulation_and_no_clipping():
    model, batches = tiny_model("llama"), token_batches(STEPS * 3)
    expected = reference(model, batches, STEPS, accumulate=3)
    got = fit(model, batches, "slideformer", STEPS, accumulate=3)
    assert relative_difference(expected, got.model) <= 1e-6


def test_adam_with_coupled_weight_decay_matches_torch_adam():
    model, batches = tiny_model("mistral"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, optimizer=torch.optim.Adam)
    got = fit(model, batches, "slideformer", STEPS, optimizer=torch.optim.Adam)
    assert relative_difference(expected, got.model) <= 1e-6


@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(maximize=True)], ids=["amsgrad", "maximize"])
def test_adamw_options_match_torch(options):
    model, batches = tiny_model("qwen3"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, optimizer_kwargs=options)
    got = fit(model, batches, "slideformer", STEPS, optimizer_kwargs=options)
    assert relative_difference(expected, got.model) <= 1e-6


@pytest.mark.parametrize("window", [dict(accumulate=2, clip=0.5), dict()], ids=["deferred", "updates-in-backward"])
def test_frozen_parameters_stay_put_and_the_rest_matches_adamw(window):
    model, batches = tiny_model("llama"), token_batches(STEPS * 2)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    expected = reference(model, batches, STEPS, **window)
    got = fit(model, batches, "slideformer", STEPS, **window)
    assert relative_difference(expected, got.model) <= 1e-6
    assert torch.equal(got.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_bf16_mixed_stays_within_bf16_noise_of_fp32_training():
    """bf16 rounding makes runs differ; ours may differ from fp32 training about as much as Lightning's own bf16."""
    model, batches = tiny_model("llama"), token_batches(STEPS)
    fp32 = reference(model, batches, STEPS)
    lightning_bf16 = fit(model, batches, "auto", STEPS, precision="bf16-mixed")
    ours = fit(model, batches, SlideStrategy(), STEPS, precision="bf16-mixed")
    noise = relative_difference(fp32, lightning_bf16.model, per_tensor_limit=0.1)
    assert relative_difference(fp32, ours.model, per_tensor_limit=0.1) <= max(2 * noise, 1e-3)
    assert relative_difference(lightning_bf16.model, ours.model, per_tensor_limit=0.1) <= 2e-2
