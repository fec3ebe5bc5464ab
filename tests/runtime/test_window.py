"""Loads that follow the CPU's updates: a dedicated unit the CPU updates (the head) loads its new weights in the
backward, a piece per backward part once its update is applied, instead of in the next forward, which reads them at
its end; a unit whose update is still running loads piece by piece as the update writes its master; and a backward
queues the loads it needs next before its gradient may wait for a free GPU buffer."""

import threading
import time

import torch

from lightning_slide import SlideConfig, SlideEngine, StepMode
from tests.runtime.helpers import (
    adamw_steps,
    engine_steps,
    param_groups,
    relative_difference,
    tiny_model,
    token_batches,
)

STEPS = 3


def _engine(model: torch.nn.Module, config: SlideConfig | None = None) -> tuple[SlideEngine, int]:
    """An fp32 engine on the CPU and the index of its head unit (llama: untied, the head a dedicated unit)."""
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config or SlideConfig(),
                         torch.device("cpu"), torch.float32, StepMode())
    head = len(engine.storages) - 1
    assert head in engine.window.dedicated
    return engine, head


def _train_recording_loads(engine: SlideEngine, head: int, model: torch.nn.Module, monkeypatch) -> list[tuple]:
    """STEPS steps; each backward waits for the head's update before its next part's leave, so that the update is
    applied while the backward still runs. Returns (unit, pass, first element, end) of every load: pass 1 forward,
    -1 backward."""
    passes, loads = [1], []
    enter, leave, load = engine.enter, engine.leave, engine.window._load

    def entering(part, direction):
        passes[0] = direction
        return enter(part, direction)

    def leaving(part, slots, direction):
        if direction < 0 and engine.adam.scheduled[head] > engine.adam.applied[head]:
            engine.adam.wait_applied(head)
        leave(part, slots, direction)

    def loading(slot, unit, written=None, start=0, end=None):
        loads.append((unit, passes[0], start, engine.storages[unit].numel if end is None else end))
        load(slot, unit, written, start, end)

    monkeypatch.setattr(engine, "enter", entering)
    monkeypatch.setattr(engine, "leave", leaving)
    monkeypatch.setattr(engine.window, "_load", loading)
    engine_steps(engine, model, token_batches(STEPS))
    return loads


def test_the_heads_new_weights_load_in_the_backward_once_the_cpu_applied_its_update(monkeypatch):
    model = tiny_model("llama")
    engine, head = _engine(model)
    loads = _train_recording_loads(engine, head, model, monkeypatch)
    assert [p for unit, p, *_ in loads if unit == head] == [1] + [-1] * STEPS  # the first forward's, then a backward's
    slot = engine.window.dedicated[head]
    assert slot.version == engine.adam.scheduled[head]
    assert torch.equal(slot.params[: engine.storages[head].numel], engine.storages[head].master)
    engine.close()


def test_loading_the_head_in_the_backward_trains_as_adamw(monkeypatch):
    model = tiny_model("llama")
    expected = adamw_steps(model, token_batches(STEPS))
    engine, head = _engine(model)
    _train_recording_loads(engine, head, model, monkeypatch)
    engine.close()
    assert relative_difference(expected, model) <= 1e-6


def test_the_heads_refresh_copies_a_piece_per_backward_part_and_its_forward_copies_the_rest(monkeypatch):
    """A head of more pieces than the backward has parts after its update: each backward part queues one piece, in
    order, and the next forward's load starts where they stopped. The run still trains as `torch.optim.AdamW`."""
    model = tiny_model("llama", vocab_size=512)
    expected = adamw_steps(model, token_batches(STEPS))
    engine, head = _engine(model, SlideConfig(chunk_elems=1024))
    piece, numel = engine.window.piece, engine.storages[head].numel
    assert numel > 8 * piece
    loads = [(p, a, b) for unit, p, a, b in _train_recording_loads(engine, head, model, monkeypatch) if unit == head]
    engine.close()
    forwards = [i for i, (p, _, _) in enumerate(loads) if p > 0]  # each forward's load of the head
    assert len(forwards) == STEPS and loads[0] == (1, 0, numel)
    for before, at in zip(forwards, forwards[1:]):
        backward = [(a, b) for _, a, b in loads[before + 1 : at]]
        assert backward and backward == [(k * piece, (k + 1) * piece) for k in range(len(backward))]
        assert loads[at] == (1, len(backward) * piece, numel)
    assert relative_difference(expected, model) <= 1e-6


def test_a_dedicated_unit_whose_update_is_not_applied_yet_is_left_for_its_forward():
    model = tiny_model("llama")
    engine, head = _engine(model)
    engine_steps(engine, model, token_batches(1))
    engine.adam.scheduled[head] += 1  # as though the head's next update were launched and still running
    before = engine.window.load_bytes[head]
    engine.window.refresh_dedicated()
    assert engine.window.load_bytes[head] == before
    engine.adam.scheduled[head] -= 1
    engine.close()


def test_a_load_of_a_unit_the_cpu_is_still_updating_copies_each_piece_once_the_update_has_written_it():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), SlideConfig(chunk_elems=1024, slots=2),
                         torch.device("cpu"), torch.float32, StepMode())
    window, adam, unit = engine.window, engine.adam, 1  # the first block
    master, piece = engine.storages[unit].master, window.piece
    assert master.numel() > 2 * piece
    adam.schedule(unit)  # an update launched, its chunks still to come
    new = master + 1
    slot = window.ring[0]
    loading = threading.Thread(target=window._load, args=(slot, unit))
    loading.start()
    master[:piece] = new[:piece]  # the update's first chunk
    adam._wrote(unit, piece)
    deadline = time.monotonic() + 30
    while not torch.equal(slot.params[:piece], new[:piece]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(slot.params[:piece], new[:piece])  # copied before the update ended
    assert loading.is_alive()
    master[piece:] = new[piece:]  # the rest, then the update is applied
    adam._finish(unit)
    engine.failure.notify()
    loading.join(30)
    assert not loading.is_alive()
    assert torch.equal(slot.params[: master.numel()], new)
    engine.close()


def test_a_backward_queues_the_next_units_load_before_its_gradient_may_wait_for_a_buffer(monkeypatch):
    """Two slots for three blocks (one unit loaded ahead): the first block is not resident when the backward reaches
    the second, whose gradient may then wait for a free GPU buffer (the copy thread frees one only as the optimizer
    takes its chunks); the first block's load must not wait behind it."""
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), SlideConfig(slots=2),
                         torch.device("cpu"), torch.float32, StepMode())
    events = []
    enter, store, load = engine.enter, engine.grads.store, engine.window._load

    def entering(part, direction):
        events.append(("enter", part.unit, direction))
        return enter(part, direction)

    def storing(part, bindings, grads):
        events.append(("store", part.unit))
        store(part, bindings, grads)

    def loading(slot, unit, written=None, start=0, end=None):
        events.append(("load", unit))
        load(slot, unit, written, start, end)

    monkeypatch.setattr(engine, "enter", entering)
    monkeypatch.setattr(engine.grads, "store", storing)
    monkeypatch.setattr(engine.window, "_load", loading)
    engine_steps(engine, model, token_batches(2))
    second = len(events) - 1 - events[::-1].index(("enter", 2, -1))  # the last backward of the second block
    assert events[second + 1 : second + 3] == [("load", 1), ("store", 2)]
    engine.close()

