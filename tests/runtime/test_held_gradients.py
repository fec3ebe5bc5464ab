"""A clipped step without accumulation holds each unit's gradient as it came (the compute dtype), not as fp32 sums."""

import copy
import math
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

import lightning_slide.layer_adam as layer_adam
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy, StepMode
from lightning_slide.gradients import GradRouter
from lightning_slide.norm import GlobalNorm
from tests.runtime.helpers import fit, tiny_model, token_batches

STEPS = 4


def _train_engine(rows: int, steps: int = 2, mode: StepMode = StepMode(clip_norm=1.0),
                  dtype: torch.dtype = torch.bfloat16, activations: str = "cpu",
                  before_step: Callable[[SlideEngine], None] = lambda engine: None) -> SlideEngine:
    """A tiny Llama trained `steps` steps of `rows` x 16 tokens by the engine alone (no Lightning); `before_step`
    runs between each backward and its optimizer step (where Lightning's `on_before_optimizer_step` runs)."""
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(activations=activations),
                         torch.device("cpu"), dtype, mode)
    for x in token_batches(steps, batch=rows):
        engine.new_micro_batch()
        engine.begin_step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
            model(input_ids=x, labels=x).loss.backward()
        before_step(engine)
        engine.end_step()
    engine.synchronize()
    return engine


def test_held_low_precision_gradients_train_exactly_as_fp32_sums_of_the_same_gradients(monkeypatch):
    """bf16 gradients widened to fp32 are the values fp32 sums would hold: the parameters are bit-equal, also
    when a unit's gradient reaches AdamW in several widened pieces."""
    monkeypatch.setattr(layer_adam, "WIDEN_ELEMS", 1000)
    model, batches = tiny_model("llama"), token_batches(STEPS)
    held = fit(model, batches, SlideStrategy(), STEPS, clip=0.05, precision="bf16-mixed")
    # a scheduler that would accumulate from epoch 1000 on: every step of this fit keeps fp32 sums of one gradient
    sums = fit(model, batches, SlideStrategy(), STEPS, clip=0.05, precision="bf16-mixed",
               callbacks=[GradientAccumulationScheduler({0: 1, 1000: 2})])
    assert all(torch.equal(p, q) for p, q in zip(held.model.parameters(), sums.model.parameters()))


@pytest.mark.parametrize(
    "mode, dtype, held",
    [(StepMode(clip_norm=1.0), torch.bfloat16, torch.bfloat16), (StepMode(clip_norm=1.0), torch.float32, torch.float32),
     (StepMode(accumulates=True, clip_norm=1.0), torch.bfloat16, torch.float32),
     (StepMode(manual=True), torch.bfloat16, torch.float32), (StepMode(), torch.bfloat16, None)],
    ids=["clipped-bf16", "clipped-fp32", "accumulated", "manual", "eager"],
)
def test_gradients_are_held_in_the_compute_dtype_only_where_nothing_is_summed(mode, dtype, held):
    engine = _train_engine(2, mode=mode, dtype=dtype, activations="device")
    assert {None if s.grad_acc is None else s.grad_acc.dtype for s in engine.storages} == {held}
    engine.close()


def test_a_second_backward_before_a_step_that_holds_single_gradients_is_refused():
    model, x = tiny_model("llama"), token_batches(1)[0]
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(), torch.device("cpu"),
                         torch.bfloat16, StepMode(clip_norm=1.0))
    engine.new_micro_batch()
    engine.begin_step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x, labels=x).loss.backward()
        engine.new_micro_batch()
        with pytest.raises(RuntimeError, match="second gradient before its optimizer step.*accumulate_grad_batches"):
            model(input_ids=x, labels=x).loss.backward()
    engine.close()




@pytest.mark.parametrize("rows, own", [(32, {"embed"}), (2, {"embed", "block.0", "block.1", "block.2", "head"})],
                         ids=["inputs-larger-than-gradients", "inputs-smaller"])
def test_a_unit_whose_saved_input_buffer_can_hold_its_gradient_needs_no_gradient_memory_of_its_own(rows, own):
    engine = _train_engine(rows)
    assert {s.name for s in engine.storages if s.grad_acc is not None} == own
    engine.close()


def test_saved_input_buffers_that_could_not_be_page_locked_lend_no_gradient_home(monkeypatch):
    """On a GPU a copy lands straight in host memory only where that is page-locked (`pin_` may fail, e.g. at the
    locked-memory limit): such buffers hold no gradient, which waits in a buffer of its own, with the same bits."""
    lent = _train_engine(32)
    monkeypatch.setattr(GradRouter, "_lands_directly", lambda self, pinned: pinned)  # as on CUDA; nothing is pinned
    own = _train_engine(32)
    assert all(s.grad_acc is not None for s in own.storages)
    assert all(torch.equal(a.master, b.master) for a, b in zip(lent.storages, own.storages))
    lent.close(), own.close()


def test_a_state_read_between_the_backward_and_the_step_leaves_the_gradients_buffers_lent_to_their_updates():
    """A read of the state (`synchronize`) before the optimizer step runs no held gradient's update: the next
    forward must still wait for those updates before it saves its inputs into the buffers the gradients wait in."""
    lent_at_read = []

    def read_state(engine: SlideEngine) -> None:
        engine.synchronize()
        lent_at_read.append(len(engine.grads.book.lent))

    plain, read = _train_engine(32), _train_engine(32, before_step=read_state)
    assert lent_at_read and all(n == 4 for n in lent_at_read)  # the three blocks and the head
    assert all(torch.equal(a.master, b.master) for a, b in zip(plain.storages, read.storages))
    plain.close(), read.close()


def test_gradients_in_saved_input_buffers_train_exactly_as_fp32_sums_of_the_same_gradients():
    model, batches = tiny_model("llama"), token_batches(STEPS, batch=32)
    lent = fit(model, batches, SlideStrategy(activations="cpu"), STEPS, clip=0.05, precision="bf16-mixed")
    sums = fit(model, batches, SlideStrategy(activations="cpu"), STEPS, clip=0.05, precision="bf16-mixed",
               callbacks=[GradientAccumulationScheduler({0: 1, 1000: 2})])
    assert all(torch.equal(p, q) for p, q in zip(lent.model.parameters(), sums.model.parameters()))



def test_a_nan_gradient_norm_steps_as_torch_does_and_the_warning_names_the_units():
    """A NaN loss: torch's clip_grad_norm_ (error_if_nonfinite=False) makes every gradient NaN and AdamW steps
    on that; the engine's parameters are the same, and its warning names the units whose gradients were NaN."""
    model, x = tiny_model("llama"), token_batches(1)[0]
    expected = copy.deepcopy(model)
    opt = torch.optim.AdamW(expected.parameters(), lr=1e-3)
    (expected(input_ids=x, labels=x).loss * math.nan).backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    opt.step()
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), SlideConfig(), torch.device("cpu"),
                         torch.float32, StepMode(clip_norm=1.0))
    engine.new_micro_batch()
    engine.begin_step()
    (model(input_ids=x, labels=x).loss * math.nan).backward()
    with pytest.warns(RuntimeWarning, match=r"norm is nan .*'embed', 'block\.0'.*'head'"):
        engine.end_step()
    engine.synchronize()
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True, msg=name)
    engine.close()


def test_an_infinite_gradient_norm_scales_every_gradient_to_zero_as_clip_grad_norm_does():
    """torch multiplies by max_norm / (inf + eps) = 0; AdamW divides by the inverse: x / inf is x * 0, sign
    included, and an infinite element becomes NaN either way."""
    norm = GlobalNorm(1.0)
    norm.add(torch.tensor([1.0, math.inf]), unit=3)
    norm.add(torch.tensor([0.5]), unit=1)
    norm.settle()
    grads = torch.tensor([-2.0, 0.0, 3.0, math.inf])
    torch.testing.assert_close(grads / norm.grad_scale, grads * 0.0, rtol=0, atol=0, equal_nan=True)
    assert not norm.finite and norm.nonfinite_units() == [3]


def test_a_units_squared_norm_sums_its_chunks_so_an_earlier_chunks_infinity_names_the_unit():
    """The optimizer thread measures accumulated sums chunk by chunk as it adds the last gradient to them."""
    norm = GlobalNorm(1.0)
    norm.add(torch.tensor([math.inf, 0.0]), unit=3)
    norm.add(torch.tensor([2.0, 2.0]), unit=3)
    norm.add(torch.tensor([1.0, 1.0]), unit=4)
    norm.add(torch.tensor([1.0, 1.0]), unit=4)
    assert norm.units[4] == pytest.approx(4.0) and norm.nonfinite_units() == [3]
