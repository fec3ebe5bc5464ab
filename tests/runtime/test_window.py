"""The window's dedicated slots: a unit the CPU updates (the head) loads its new weights in the backward, once its
update is applied, instead of in the next forward, which reads them at its end."""

import copy

import torch

from lightning_slide import SlideConfig, SlideEngine, StepMode
from tests.runtime.helpers import param_groups, relative_difference, tiny_model, token_batches

STEPS = 3


def _engine(model: torch.nn.Module) -> tuple[SlideEngine, int]:
    """An fp32 engine on the CPU and the index of its head unit (llama: untied, the head a dedicated unit)."""
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), SlideConfig(), torch.device("cpu"),
                         torch.float32, StepMode())
    head = len(engine.storages) - 1
    assert head in engine.window.dedicated
    return engine, head


def _train_recording_loads(engine: SlideEngine, head: int, model: torch.nn.Module, monkeypatch) -> list[tuple]:
    """STEPS steps; each backward waits for the head's update before its next part's leave, so that the update is
    applied while the backward still runs. Returns (unit, pass) of every load: 1 forward, -1 backward."""
    passes, loads = [1], []
    enter, leave, load = engine.enter, engine.leave, engine.window._load

    def entering(part, direction):
        passes[0] = direction
        return enter(part, direction)

    def leaving(part, slots, direction):
        if direction < 0 and engine.adam.scheduled[head] > engine.adam.applied[head]:
            engine.adam.wait_applied(head)
        leave(part, slots, direction)

    def loading(slot, unit, written=None):
        loads.append((unit, passes[0]))
        load(slot, unit, written)

    monkeypatch.setattr(engine, "enter", entering)
    monkeypatch.setattr(engine, "leave", leaving)
    monkeypatch.setattr(engine.window, "_load", loading)
    for x in token_batches(STEPS):
        engine.new_micro_batch()
        engine.begin_step()
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
    engine.synchronize()
    return loads


def test_the_heads_new_weights_load_in_the_backward_once_the_cpu_applied_its_update(monkeypatch):
    model = tiny_model("llama")
    engine, head = _engine(model)
    loads = _train_recording_loads(engine, head, model, monkeypatch)
    assert [p for unit, p in loads if unit == head] == [1] + [-1] * STEPS  # the first forward's, then one a backward
    slot = engine.window.dedicated[head]
    assert slot.version == engine.adam.scheduled[head]
    assert torch.equal(slot.params[: engine.storages[head].numel], engine.storages[head].master)
    engine.close()


def test_loading_the_head_in_the_backward_trains_as_adamw(monkeypatch):
    model = tiny_model("llama")
    expected = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(param_groups(expected), lr=1e-2)
    for x in token_batches(STEPS):
        expected(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    engine, head = _engine(model)
    _train_recording_loads(engine, head, model, monkeypatch)
    engine.close()
    assert relative_difference(expected, model) <= 1e-6


def test_a_dedicated_unit_whose_update_is_not_applied_yet_is_left_for_its_forward():
    model = tiny_model("llama")
    engine, head = _engine(model)
    x = token_batches(1)[0]
    engine.new_micro_batch()
    engine.begin_step()
    model(input_ids=x, labels=x).loss.backward()
    engine.end_step()
    engine.synchronize()
    engine.adam.scheduled[head] += 1  # as though the head's next update were launched and still running
    before = engine.window.load_bytes[head]
    engine.window.refresh_dedicated()
    assert engine.window.load_bytes[head] == before
    engine.adam.scheduled[head] -= 1
    engine.close()
