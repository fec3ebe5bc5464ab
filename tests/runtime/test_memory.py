"""Steady-state steps hold on to nothing: no graph, saved input or call survives its step."""

import gc

import torch

from lightning_slide import SlideConfig, SlideEngine
from lightning_slide.parts import Call
from lightning_slide.window import Window
from tests.runtime.helpers import (
    adamw_steps,
    engine_steps,
    param_groups,
    relative_difference,
    tiny_model,
    token_batches,
)


def _live_calls() -> int:
    gc.collect()
    return sum(isinstance(o, Call) for o in gc.get_objects())


def test_nothing_from_a_step_outlives_it():
    model = tiny_model("qwen2-tied")
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(activations="cpu"),
                         torch.device("cpu"), torch.float32)
    for x in token_batches(3):
        engine.new_micro_batch()
        engine.begin_step()
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
        assert _live_calls() == 0
    engine.close()


def test_landing_buffers_are_no_larger_than_the_largest_unit():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(), torch.device("cpu"),
                         torch.float32)
    largest = max(s.trainable_numel for s in engine.storages)
    assert all(b.numel() <= largest for b in engine.pump.ring.buffers)
    engine.close()


def _loaded_bytes_per_step(slots: int | str, monkeypatch, steps: int = 1) -> int:
    """Bytes loaded into the window during the last of `steps` steps, for a 6-block Llama. The head's early load in
    the backward, whose step depends on when the optimizer thread applies its update (`test_window`), is off."""
    monkeypatch.setattr(Window, "refresh_dedicated", lambda self: None)
    model = tiny_model("llama", num_hidden_layers=6)
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(slots=slots), torch.device("cpu"),
                         torch.float32)
    for x in token_batches(steps):
        before = engine.stats()["h2d_bytes"]
        engine.new_micro_batch()
        engine.begin_step()
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
    loaded = engine.stats()["h2d_bytes"] - before
    engine.close()
    return loaded


def test_a_window_as_large_as_the_model_loads_each_unit_once_per_step(monkeypatch):
    blocks_and_vocab_units = sum(p.numel() for p in tiny_model("llama", num_hidden_layers=6).parameters()) * 4
    assert _loaded_bytes_per_step(8, monkeypatch) == blocks_and_vocab_units
    assert _loaded_bytes_per_step(2, monkeypatch) > blocks_and_vocab_units


def test_a_window_allocates_no_more_block_slots_than_the_model_has_blocks():
    model = tiny_model("llama", num_hidden_layers=2)
    for slots in (8, "auto"):  # "auto" starts on three
        engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(slots=slots),
                             torch.device("cpu"), torch.float32)
        assert len(engine.window.ring) == 2
        engine.close()


def test_an_auto_window_grows_after_the_first_step_until_each_unit_loads_once_per_step(monkeypatch):
    """On the CPU nothing limits it: every block gets a slot (on CUDA, as many as the spare VRAM holds)."""
    blocks_and_vocab_units = sum(p.numel() for p in tiny_model("llama", num_hidden_layers=6).parameters()) * 4
    assert _loaded_bytes_per_step("auto", monkeypatch, steps=1) > blocks_and_vocab_units
    assert _loaded_bytes_per_step("auto", monkeypatch, steps=2) == blocks_and_vocab_units


def test_a_resumed_run_grows_its_auto_window_after_its_own_first_step():
    model = tiny_model("llama", num_hidden_layers=6)
    optimizer = torch.optim.AdamW(model.parameters())
    engine = SlideEngine(model, optimizer, SlideConfig(slots="auto"), torch.device("cpu"), torch.float32)
    engine._step = 7  # what loading a checkpoint's optimizer state sets
    x = token_batches(1)[0]
    engine.new_micro_batch()
    engine.begin_step()
    model(input_ids=x, labels=x).loss.backward()
    engine.end_step()
    assert len(engine.window.ring) == 6
    engine.close()


def test_the_log_says_how_the_first_step_sized_the_window_and_kept_graphs(caplog):
    import logging

    from tests.runtime.helpers import fit

    with caplog.at_level(logging.INFO):
        fit(tiny_model("llama", num_hidden_layers=6), token_batches(3), "slideformer", 3)
    lines = [r.getMessage() for r in caplog.records if "window sized" in r.getMessage()]
    assert lines == ["slideformer window sized for micro-batches of up to 32 tokens: 6 of 6 blocks have a GPU slot "
                     "(3 added, 0.00 GiB); 0.00 GiB for kept graphs (recompute='auto')"]


def test_the_log_counts_no_more_slots_than_blocks_when_the_ring_starts_larger(caplog):
    import logging

    from tests.runtime.helpers import fit

    with caplog.at_level(logging.INFO):
        fit(tiny_model("llama", num_hidden_layers=2), token_batches(3), "slideformer", 3)
    (line,) = [r.getMessage() for r in caplog.records if "window sized" in r.getMessage()]
    assert ": 2 of 2 blocks have a GPU slot (0 added, 0.00 GiB);" in line


def test_a_lookahead_load_skips_a_unit_whose_update_is_still_pending():
    """At a step's start the next units may still be updating: their own calls wait, the prefetch does not."""
    import threading

    model = tiny_model("llama", num_hidden_layers=6)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(slots=3), torch.device("cpu"),
                         torch.float32)
    engine.adam.schedule(2)  # an update of unit 2 launched, not applied yet
    embedding = next(p for p in engine.parts if p.unit == 0)
    left = threading.Thread(target=engine.leave, args=(embedding, {}, +1), daemon=True)
    left.start()
    left.join(timeout=5)
    pending = left.is_alive()
    engine.adam.applied[2] += 1
    left.join()
    assert not pending, "the prefetch waited for unit 2's update"
    assert engine.window.holding(1) is not None and engine.window.holding(2) is None
    engine.close()


def test_a_lookahead_load_does_not_pass_a_unit_whose_update_is_still_pending():
    """The loads' lane is first in, first out: a later unit loaded ahead of a pending one (the first block, at a
    step's start) would hold that unit's own load up behind it."""
    model = tiny_model("llama", num_hidden_layers=6)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(slots=3), torch.device("cpu"),
                         torch.float32)
    engine.adam.schedule(1)  # the first block's update launched, not applied yet
    embedding = next(p for p in engine.parts if p.unit == 0)
    engine.leave(embedding, {}, +1)
    assert engine.window.holding(1) is None and engine.window.holding(2) is None
    engine.adam.applied[1] += 1
    engine.close()


def test_a_load_that_waits_for_an_update_is_counted_against_that_unit():
    import threading
    import time

    model = tiny_model("llama", num_hidden_layers=4)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(slots=3), torch.device("cpu"),
                         torch.float32)
    engine.adam.schedule(2)
    load = threading.Thread(target=engine.window.ensure, args=(2, 1, +1, set()), daemon=True)
    load.start()
    time.sleep(0.05)
    engine.adam.applied[2] += 1
    load.join()
    stats = engine.stats()
    assert list(stats["wait_update_by_unit_s"]) == [engine.storages[2].name]
    assert stats["wait_update_by_unit_s"][engine.storages[2].name] == stats["wait_update_s"] >= 0.04
    engine.close()


def test_the_optimizer_threads_time_is_counted_against_each_unit_it_updates():
    model = tiny_model("llama", num_hidden_layers=4)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(), torch.device("cpu"),
                         torch.float32)
    x = token_batches(1)[0]
    engine.new_micro_batch()
    engine.begin_step()
    model(input_ids=x, labels=x).loss.backward()
    engine.end_step()
    engine.synchronize()
    work = engine.stats()["update_work_by_unit_s"]
    assert sorted(work) == sorted(s.name for s in engine.storages if s.trainable_numel)
    assert all(t > 0 for t in work.values()) and sum(work.values()) <= engine.stats()["update_busy_s"]
    engine.close()


def test_the_forwards_last_call_keeps_its_input_on_the_device_for_the_backward_that_comes_next(monkeypatch):
    """Its backward is the first: an input sent out and brought straight back would hold it up (the head's at 8B
    64x1024). The first forward does not know yet which call is its last (its host buffer goes after); the run still
    trains as AdamW."""
    model = tiny_model("llama")
    expected = adamw_steps(model, token_batches(3))
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), SlideConfig(activations="cpu"),
                         torch.device("cpu"), torch.float32)
    saves, save = [], engine.activations.save

    def saving(key, value, keep=False):
        saves.append((key[0], keep))
        return save(key, value, keep)

    monkeypatch.setattr(engine.activations, "save", saving)
    engine_steps(engine, model, token_batches(3))
    calls = max(position for position, _ in saves) + 1
    assert all(position != calls - 1 for position, _ in engine.activations._pool)  # the first step's buffer went
    engine.close()
    per_step = [[position for position, keep in saves[k : k + len(saves) // 3] if keep]
                for k in range(0, len(saves), len(saves) // 3)]
    assert per_step[0] == [] and per_step[1] == per_step[2] == [calls - 1]
    assert relative_difference(expected, model) <= 1e-6
