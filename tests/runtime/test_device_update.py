"""Compact moments updated on the device (`device_update`): the same arithmetic as the CPU pool's, so on the CPU
(standing in for the GPU here) both train bit for bit alike, eager and clipped, in several chunks and pieces."""

import copy
import threading

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_slide.device_update as device_update
import lightning_slide.engine as engine_module
import lightning_slide.gradients as gradients
import lightning_slide.layer_adam as layer_adam
import lightning_slide.transfer as transfer
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy, StepMode
from lightning_slide.window import Window
from tests.runtime.helpers import (
    CausalLM,
    assert_same_state,
    engine_steps,
    fit,
    param_groups,
    reference,
    relative_difference,
    tiny_model,
    token_batches,
    trainer,
)


def _train(precision: str, mode: StepMode, on_device: bool, monkeypatch, slots: int | str = "auto",
           gpu_update_blocks: int | str = 0, arch: str = "llama", resident_moments: int = 0) -> SlideEngine:
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device if on_device else None)
    model = tiny_model(arch)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    config = SlideConfig(moment_precision=precision, slots=slots, gpu_update_blocks=gpu_update_blocks,
                         resident_moments=resident_moments)
    engine = SlideEngine(model, optimizer, config, torch.device("cpu"), torch.float32, mode)
    assert (engine.adam.on_device is not None) == on_device
    engine_steps(engine, model, token_batches(3))
    return engine


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_updates_on_the_device_train_bit_for_bit_as_the_cpu_pool(precision, mode, monkeypatch):
    """Pieces of 256 elements (bf16 noise is drawn per piece) and device chunks of 1,024: several chunks per unit,
    taking the buffer sets in turn."""
    monkeypatch.setattr(layer_adam, "SCRATCH_ELEMS", 256)
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(device_update, "code_kernels_on", lambda device: False)  # the codec's torch ops
    pool, device = (_train(precision, mode, on, monkeypatch) for on in (False, True))
    assert device.adam.on_device.chunk == 1024 and not device.adam.on_device.code_kernels
    assert_same_state(pool, device)
    pool.close(), device.close()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_compact_moments_coded_by_the_kernels_train_bit_for_bit_as_the_cpu_pool(precision, mode, monkeypatch):
    """`ops.moment_codes` (here in Triton's interpreter) decodes and encodes each chunk's moments in the device
    updater: the same bits as the CPU pool's torch ops, over several chunks and pieces and a partial last block."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(layer_adam, "SCRATCH_ELEMS", 256)
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    pool, device = (_train(precision, mode, on, monkeypatch) for on in (False, True))
    assert device.adam.on_device.code_kernels
    assert_same_state(pool, device)
    pool.close(), device.close()



@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_updates_on_the_device_write_resident_weights_into_their_slots_instead_of_loading_them_again(mode,
                                                                                                    monkeypatch):
    """Every block resident: after the first step, only what no update wrote is loaded. (The CPU-updated head's early
    load in the backward, whose step depends on when the optimizer thread applies its update, is off: `test_window`.)"""
    monkeypatch.setattr(Window, "refresh_dedicated", lambda self: None)
    pool, device = (_train("int8", mode, on, monkeypatch, slots=8) for on in (False, True))
    assert_same_state(pool, device)
    loads = [e.window.bytes for e in (pool, device)]
    embedding_and_head = sum(device.storages[u].numel * 4 for u in device.window.dedicated)
    blocks = sum(s.numel * 4 for u, s in enumerate(device.storages) if u not in device.window.dedicated)
    assert loads[0] == 3 * (blocks + embedding_and_head)  # every unit, every step
    assert loads[1] == blocks + embedding_and_head  # the first step's loads only
    pool.close(), device.close()


def test_the_engine_counts_the_bytes_of_loads_per_unit_and_of_each_kind_of_copy(monkeypatch):
    """Two slots for the tiny model's blocks: the ring's loads, the updater's state copies and the pump's gradients
    (the embedding and head, updated by the CPU pool here) are told apart, and they add up to the totals."""
    engine = _train("int8", StepMode(), True, monkeypatch, slots=2)
    stats = engine.stats()
    assert stats["h2d_bytes"] == stats["h2d_loads_bytes"] + stats["h2d_saved_inputs_bytes"] + stats["h2d_updates_bytes"]
    assert stats["d2h_bytes"] == (stats["d2h_gradients_bytes"] + stats["d2h_saved_inputs_bytes"]
                                  + stats["d2h_updates_bytes"] + stats["d2h_weights_back_bytes"])
    assert stats["h2d_updates_bytes"] > 0 and stats["d2h_updates_bytes"] > 0
    by_unit = stats["load_by_unit_bytes"]
    assert sum(by_unit.values()) == stats["h2d_loads_bytes"] == engine.window.bytes
    assert set(by_unit) == {s.name for s in engine.storages}  # with 2 slots every block loads again
    engine.close()


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("precision, blocks", [("bf16", 0), ("fp32", 2)], ids=["bf16", "fp32-2-of-3-blocks"])
@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_slots_taken_back_before_their_updates_write_there_keep_the_updates_off_them(slots, precision, blocks,
                                                                                    mode, monkeypatch):
    """A ring smaller than the model: the backward takes back slots whose blocks' updates have not started."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    pool, device = (_train(precision, mode, on, monkeypatch, slots=slots, gpu_update_blocks=blocks)
                    for on in (False, True))
    assert_same_state(pool, device)
    pool.close(), device.close()


def test_a_slot_write_goes_to_the_first_of_the_updater_and_the_window_to_ask():
    taken = device_update.SlotWrite(torch.empty(1), None)
    assert taken.take() and not taken.drop() and taken.take()
    dropped = device_update.SlotWrite(torch.empty(1), None)
    assert dropped.drop() and not dropped.take()


@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_fp32_blocks_updated_on_the_device_train_bit_for_bit_as_on_the_cpu(mode, monkeypatch):
    """Two of the three decoder blocks, spread over them (units 1 and 3), go to the device, the rest stay."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    cpu = _train("fp32", mode, False, monkeypatch)
    device = _train("fp32", mode, True, monkeypatch, gpu_update_blocks=2)
    assert device.adam.on_device.units == {1, 3}
    assert_same_state(cpu, device)
    cpu.close(), device.close()


@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_moments_kept_in_device_memory_train_bit_for_bit_as_moments_in_host_memory(mode, monkeypatch):
    """`resident_moments=1`: the lowest of the two blocks the device updates (unit 1) keeps its moments there
    after the first step; its later updates move only its master, and each state read finds the host copy current."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    host = _train("fp32", mode, True, monkeypatch, gpu_update_blocks=2)
    kept = _train("fp32", mode, True, monkeypatch, gpu_update_blocks=2, resident_moments=1)
    assert host.adam.on_device.units == kept.adam.on_device.units == {1, 3}
    assert list(kept.adam.on_device.resident) == [1]
    assert_same_state(host, kept)
    saved = 2 * 8 * kept.storages[1].trainable_numel  # the two steps after the first, moments up
    assert host.adam.on_device.bytes_up - kept.adam.on_device.bytes_up == saved
    host.close(), kept.close()


def test_a_loaded_optimizer_state_reaches_the_moments_kept_in_device_memory(monkeypatch):
    """Step 3 again from the state saved after step 2: the same result only where the load replaced the
    moments the device holds (else they would be step 3's)."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    engine = SlideEngine(model, optimizer, SlideConfig(gpu_update_blocks=2, resident_moments=2), torch.device("cpu"),
                         torch.float32, StepMode())
    first, third = token_batches(2), token_batches(1, seed=3)
    engine_steps(engine, model, first)
    assert sorted(engine.adam.on_device.resident) == [1, 3]
    state, masters = copy.deepcopy(optimizer.state_dict()), [s.master.clone() for s in engine.storages]
    engine_steps(engine, model, third)
    once = [(s.master.clone(), s.exp_avg.values.clone(), s.exp_avg_sq.values.clone()) for s in engine.storages]
    for s, master in zip(engine.storages, masters):
        s.master.copy_(master)
    engine.master_changed()
    engine.load_optimizer_state(state)
    engine_steps(engine, model, third)
    again = [(s.master, s.exp_avg.values, s.exp_avg_sq.values) for s in engine.storages]
    assert all(torch.equal(a, b) for x, y in zip(once, again) for a, b in zip(x, y))
    engine.close()


def test_a_run_without_updates_on_a_gpu_says_its_resident_moments_go_unused():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), SlideConfig(resident_moments=2),
                         torch.device("cpu"), torch.float32)
    engine_steps(engine, model, token_batches(1))
    assert "resident_moments=2 unused: no update runs on the GPU here" in engine.notes
    engine.close()


def test_a_run_keeping_moments_in_device_memory_resumes_exactly_from_its_checkpoint(tmp_path, monkeypatch):
    """Through Lightning: the checkpoint at step 4 (an epoch's end) holds the moments as the device had them then."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    model, batches = tiny_model("llama"), token_batches(2)  # 2 steps per epoch
    straight, resumed = CausalLM(copy.deepcopy(model)), CausalLM(tiny_model("llama", seed=123))
    saving = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer(SlideStrategy(gpu_update_blocks=2, resident_moments=2), 6, enable_checkpointing=True,
            callbacks=[saving]).fit(straight, DataLoader(batches, batch_size=None))
    trainer(SlideStrategy(gpu_update_blocks=2, resident_moments=2), 6).fit(
        resumed, DataLoader(batches, batch_size=None), ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"))
    assert relative_difference(straight.model, resumed.model) <= 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("mode", [StepMode(), StepMode(clip_norm=0.05)], ids=["eager", "clipped"])
def test_the_embedding_updated_on_the_device_besides_the_blocks_trains_bit_for_bit_as_on_the_cpu(arch, mode,
                                                                                                monkeypatch):
    """`gpu_update_blocks="auto"` at the H200 machine's rates: the embedding (tied to the head or not) and the
    balanced blocks go to the device, in several chunks each."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 7e14))
    cpu = _train("fp32", mode, False, monkeypatch, arch=arch)
    device = _train("fp32", mode, True, monkeypatch, gpu_update_blocks="auto", arch=arch)
    assert 0 in device.adam.on_device.units and len(device.adam.on_device.units) > 1
    assert_same_state(cpu, device)
    cpu.close(), device.close()


def test_amsgrad_keeps_every_update_on_the_cpu_where_its_running_maximum_lives_and_matches_torch(monkeypatch):
    from lightning.pytorch.callbacks import Callback

    from lightning_slide.planner import ModelShape, Plan, Setup

    class Updater(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(trainer.strategy.engine.adam.on_device)

    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    model, batches, seen = tiny_model("llama"), token_batches(3), []
    got = fit(model, batches, SlideStrategy(gpu_update_blocks=2), 3, optimizer_kwargs=dict(amsgrad=True),
              callbacks=[Updater()])
    assert seen == [None]
    assert relative_difference(reference(model, batches, 3, optimizer_kwargs=dict(amsgrad=True)), got.model) <= 1e-6
    shape = ModelShape.from_model(model, {id(p) for p in model.parameters()})
    entries = Plan.static(shape, Setup(SlideConfig(gpu_update_blocks=2), device="cuda", amsgrad=True)).entries
    assert not any("updated on the GPU" in e.what or "update buffers" in e.what for e in entries)


def test_an_fp32_run_keeps_its_updates_on_the_cpu_where_the_rates_cannot_be_measured(monkeypatch):
    """`gpu_update_blocks="auto"` (the default) measures the rates on CUDA only: on a stand-in device it is 0."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(), torch.device("cpu"),
                         torch.float32)
    assert engine.adam.on_device is None and engine.adam.device_worker is None
    engine.close()


def test_auto_gives_the_gpu_the_blocks_that_make_both_sides_end_together():
    """A CPU element a second, 12 B a second each way: with 5 of ten 10-element blocks on the GPU (and 20 more
    elements on the CPU) the CPU takes 70 s and the link (50 x 12 + 70 x 4) / 12 = 73 s; with 4, 80 s and 67 s."""
    rates = device_update.UpdateRates(cpu_elems_s=1.0, link_bytes_s=24.0, gpu_flops_s=1.0)
    assert device_update.balanced_blocks(20, [10] * 10, rates) == 5
    assert device_update.balanced_blocks(20, [10] * 10, device_update.UpdateRates(1.0, 1e-6, 1.0)) == 0  # a slow link
    assert device_update.balanced_blocks(0, [10] * 10, device_update.UpdateRates(1e-6, 24.0, 1.0)) == 10  # a slow CPU


def test_auto_gives_the_gpu_the_fewest_blocks_whose_updates_end_within_the_compute_they_run_beside():
    """The same rates: updates that end within `hidden_s` cost nothing, and the GPU's copies would only compete with
    the loads. With 2 blocks on the GPU the CPU takes 100 s and the link 53 s; with none, 120 s and 40 s."""
    rates = device_update.UpdateRates(cpu_elems_s=1.0, link_bytes_s=24.0, gpu_flops_s=1.0)
    assert device_update.balanced_blocks(20, [10] * 10, rates, hidden_s=100.0) == 2
    assert device_update.balanced_blocks(20, [10] * 10, rates, hidden_s=120.0) == 0
    assert device_update.balanced_blocks(20, [10] * 10, rates, hidden_s=60.0) == 5  # hides less than the split takes


def test_a_steps_updates_run_beside_its_last_backward_or_with_clipping_beside_the_next_forward(monkeypatch):
    """4 flops per block parameter and token of backward, 2 more where it recomputes the blocks, 2 of forward,
    at the probe's matmul rate."""
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(1.0, 1.0, 1e15))
    cuda, hidden = torch.device("cuda"), device_update.hidden_update_s
    assert hidden(cuda, 8_000_000_000, 65536, deferred=False, recomputed=False) == pytest.approx(2.097152)
    assert hidden(cuda, 8_000_000_000, 65536, deferred=False, recomputed=True) == pytest.approx(3.145728)
    assert hidden(cuda, 8_000_000_000, 65536, deferred=True, recomputed=True) == pytest.approx(1.048576)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: None)
    assert hidden(cuda, 8_000_000_000, 65536, deferred=False, recomputed=True) == 0.0


def test_updates_keep_pace_with_the_backward_where_they_end_within_the_compute_they_run_beside(monkeypatch):
    """1 element/s on the CPU, 24 bytes/s of link: 100 elements, 20 of them on the GPU (the link carries 20 x 12 +
    80 x 4 bytes each way at 12/s: 46.7 s), end when the CPU's 80 do, after 80 s."""
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(1.0, 24.0, 1.0))
    trainable, cpu = [20, 40, 40], torch.device("cpu")
    assert device_update.updates_keep_pace([0], trainable, cpu, 24.0, hidden_s=80.0)
    assert not device_update.updates_keep_pace([0], trainable, cpu, 24.0, hidden_s=79.0)
    assert not device_update.updates_keep_pace([], trainable, cpu, 24.0, hidden_s=99.0)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: None)
    assert not device_update.updates_keep_pace([0], trainable, cpu, 24.0, hidden_s=1e9)


def test_a_fitted_split_keeps_the_embedding_and_an_even_spread_of_the_blocks_auto_gave_the_gpu(monkeypatch):
    """The rates above, ten 10-element blocks between an embedding and a head of 10: "auto" gives the GPU the
    embedding and 5 blocks. Hiding nothing keeps them; hiding 100 s keeps 2 of the 5 (the CPU 100 s, the link 53)."""
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(1.0, 24.0, 1.0))
    dedicated, trainable, cpu = [True] + [False] * 10 + [True], [10] * 12, torch.device("cpu")
    units = device_update.gpu_updated_units("fp32", "auto", dedicated, set(), trainable, cpu)
    assert units == [0, 2, 4, 6, 8, 10]
    assert device_update.fitted_units(units, dedicated, trainable, cpu, 24.0, hidden_s=0.0) == units
    assert device_update.fitted_units(units, dedicated, trainable, cpu, 24.0, hidden_s=100.0) == [0, 4, 8]


def _hiding_every_update(monkeypatch) -> list[set[int]]:
    """Rates at which any step's compute hides every update, on a stand-in device; returns the lowest blocks held
    back, as the engine sets them (at its start, and where the fit changes them)."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 1.0))
    held, hold_back = [], gradients.GradRouter.hold_back
    monkeypatch.setattr(gradients.GradRouter, "hold_back",
                        lambda self, units: (held.append(set(units)), hold_back(self, units)))
    return held


def test_a_trainer_fits_the_split_to_its_first_micro_batch_and_trains_as_torchs_adamw(monkeypatch):
    """Through Lightning (the strategy hands the engine each micro-batch's tokens), at rates where any step hides
    every update: from the first micro-batch on, the stand-in device updates the embedding only."""
    _hiding_every_update(monkeypatch)
    updated, run = [], device_update.DeviceUpdater.run
    monkeypatch.setattr(device_update.DeviceUpdater, "run",
                        lambda self, storage, *args: updated.append(storage.index) or run(self, storage, *args))
    model, batches = tiny_model("llama"), token_batches(3)
    got = fit(model, batches, SlideStrategy(use_kernels=False), 3)
    assert updated == [0, 0, 0]
    assert relative_difference(reference(model, batches, 3), got.model) <= 1e-6


def test_the_fitted_split_notes_the_rates_it_was_fitted_at(monkeypatch):
    _hiding_every_update(monkeypatch)
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), SlideConfig(), torch.device("cpu"),
                         torch.float32, StepMode())
    engine.new_micro_batch(tokens=64)
    (note,) = [n for n in engine.notes if n.startswith("fp32 updates on the GPU for micro-batches of 64 tokens")]
    assert "fused CPU AdamW 3.10 G elements/s beside copies, copies both ways 72 GB/s" in note
    engine.close()


def test_where_the_updates_keep_pace_the_lowest_blocks_go_as_their_gradients_come(monkeypatch):
    """At rates where any step hides every update, the CPU updates each block as the backward hands it over, the
    lowest ones too: none waits for the embedding's gradient (the stand-in device updates the embedding)."""
    _hiding_every_update(monkeypatch)
    order, adam_ = [], layer_adam.adam_
    monkeypatch.setattr(layer_adam, "adam_", lambda storage, *a: (order.append(storage.name), adam_(storage, *a)))
    model, batches = tiny_model("llama", num_hidden_layers=6), token_batches(1)
    got = fit(model, batches, SlideStrategy(use_kernels=False), 1)
    assert order == ["head", "block.5", "block.4", "block.3", "block.2", "block.1", "block.0"]
    assert relative_difference(reference(model, batches, 1), got.model) <= 1e-6


def test_accumulated_steps_whose_updates_keep_pace_train_as_torchs_adamw(monkeypatch):
    """Rates that hide every update, two micro-batches a step over three steps: the sums of the lowest blocks go
    to the host as they come in every micro-batch, and the last one's updates as their sums are complete."""
    held = _hiding_every_update(monkeypatch)
    model, batches = tiny_model("llama"), token_batches(6)
    got = fit(model, batches, SlideStrategy(use_kernels=False), 3, accumulate=2)
    assert held == [{1, 2, 3}, set()]  # the lowest three blocks, until the first micro-batch is fitted
    assert relative_difference(reference(model, batches, 3, accumulate=2), got.model) <= 1e-6


def test_clipped_steps_hold_the_lowest_blocks_back_whatever_the_rates(monkeypatch):
    """Clipped updates wait for the norm and run in forward order after the backward: their gradients keep the
    order that sends the next forward's first units first."""
    held = _hiding_every_update(monkeypatch)
    model, batches = tiny_model("llama"), token_batches(2)
    got = fit(model, batches, SlideStrategy(use_kernels=False), 2, clip=1.0)
    assert held == [{1, 2, 3}]
    assert relative_difference(reference(model, batches, 2, clip=1.0), got.model) <= 1e-6


def test_auto_splits_the_fp32_blocks_at_the_measured_rates(monkeypatch):
    """The head (dedicated) and a disk unit stay on the CPU and count on its side; at these rates the embedding
    (dedicated) goes to the GPU besides the balanced blocks."""
    rates = device_update.UpdateRates(cpu_elems_s=1.0, link_bytes_s=48.0, gpu_flops_s=1.0)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: rates)
    dedicated, trainable = [True, False, False, False, False, True], [1, 10, 10, 10, 1, 1]
    units = device_update.gpu_updated_units("fp32", "auto", dedicated, {4}, trainable, torch.device("cpu"))
    assert units == [0, 1, 3]  # blocks: the CPU 13 s, the link 12 s; with one more 15 s (link), one fewer 23 s (CPU)
    assert device_update.gpu_updated_units("fp32", 1, dedicated, {4}, trainable, torch.device("cpu")) == [2]
    assert device_update.gpu_updated_units("int8", 0, dedicated, {4}, trainable, torch.device("cpu")) == [0, 1, 2,
                                                                                                          3, 5]


def test_auto_gives_the_gpu_the_embedding_besides_the_balanced_blocks_where_its_chain_is_shorter_there(monkeypatch):
    """The embedding's gradient is complete only when the backward ends and the next forward needs it first."""
    dedicated, trainable = [True, False, False, False, False, True], [1, 10, 10, 10, 1, 1]
    for cpu_rate, link, first in ((3.1, 72.0, True), (100.0, 72.0, False)):  # H200 machine's rates; a fast CPU
        rates = device_update.UpdateRates(cpu_elems_s=cpu_rate, link_bytes_s=link, gpu_flops_s=1.0)
        monkeypatch.setattr(device_update, "measured_rates", lambda device, rates=rates: rates)
        units = device_update.gpu_updated_units("fp32", "auto", dedicated, set(), trainable, torch.device("cpu"))
        blocks = device_update.balanced_blocks(2, [10, 10, 10, 1], rates)
        assert (units[:1] == [0]) is first and len(units) == blocks + first


def test_the_gpus_units_queue_on_an_optimizer_thread_of_their_own(monkeypatch):
    """The first blocks' gradients come last: behind the CPU's queue their updates would start only when it ends."""
    handled: dict[str, set[int]] = {}
    handle = layer_adam.LayerAdam._handle

    def record(self, item):
        handled.setdefault(threading.current_thread().name, set()).add(item.unit)
        handle(self, item)

    monkeypatch.setattr(layer_adam.LayerAdam, "_handle", record)
    engine = _train("fp32", StepMode(), True, monkeypatch, gpu_update_blocks=2)
    assert handled == {"slideformer-layer-adam-gpu": {1, 3}, "slideformer-layer-adam": {0, 2, 4}}
    stats = engine.stats()
    assert stats["gpu_update_busy_s"] > 0 and stats["gpu_updated_units"] == ["block.0", "block.2"]
    # only the CPU's units wait for gradients to land on the host: the GPU's stay in their device buffers
    assert set(stats["wait_landing_by_unit_s"]) == {"embed", "block.1", "head"}
    engine.close()


def test_the_gpus_updates_do_not_queue_behind_the_gradients_the_copy_thread_lands(monkeypatch):
    """A gradient the GPU updates stays in its device buffer: its update is queued as the backward completes it,
    not behind the CPU's gradients on the copy thread, which wait there for landing buffers the CPU frees. Here the
    copy thread lands nothing until the GPU has taken an update."""
    gpu_took = threading.Event()
    copy, handle = transfer.GradPump._handle, layer_adam.LayerAdam._handle

    def copy_after_the_gpu(self, item):
        if not gpu_took.wait(timeout=5):
            raise TimeoutError("the GPU's update waited for the copy thread")
        copy(self, item)

    def take(self, item):
        handle(self, item)
        if isinstance(item, layer_adam.DeviceGrad):
            gpu_took.set()

    monkeypatch.setattr(transfer.GradPump, "_handle", copy_after_the_gpu)
    monkeypatch.setattr(layer_adam.LayerAdam, "_handle", take)
    engine = _train("fp32", StepMode(), True, monkeypatch, gpu_update_blocks=2)
    assert engine.stats()["gpu_updated_units"] == ["block.0", "block.2"]
    engine.close()


def test_a_buffer_set_is_a_whole_number_of_pieces_within_the_largest_unit():
    assert device_update.chunk_elems(218_103_808, 1 << 16) == 1 << 23
    assert device_update.chunk_elems(3000, 1000) == 3000
    assert device_update.chunk_elems(2500, 1000) == 2000  # two pieces; the unit's third, partial one is a chunk
    assert device_update.chunk_elems(700, 700) == 700
    assert device_update.chunk_elems(700, 700, plane_bits=32) == 704  # whole parity bytes: still one chunk a unit


def test_a_chunks_bf16_noise_is_what_the_cpu_pieces_draw_also_across_the_tables_end():
    """Each CPU piece starts its draw at (its position) mod the period and reads on; a chunk's gather does the
    same per piece, so a piece that starts just before the period's end reads past it, as on the CPU."""
    from lightning_slide.moment_codec import NOISE_PERIOD, Bf16Codec, noise_position

    codecs, piece, n = (Bf16Codec(0), Bf16Codec(1)), 256, 1024
    updater = device_update.DeviceUpdater(torch.device("cpu"), codecs, 4096, piece, code_kernels=False)
    room = updater.sets[0]
    mix = noise_position(7, 3, 0, 0)
    start = (NOISE_PERIOD - mix - 300) % NOISE_PERIOD  # the second piece's position wraps
    got = updater.noise_for(room, 7, 3, start, n)
    for k in range(2):
        position = noise_position(7, 3, k, start)
        want = torch.cat([codecs[0].noise[(position + a) % NOISE_PERIOD:][:piece] for a in range(0, n, piece)])
        assert torch.equal(got[k * n : (k + 1) * n], want)


def test_the_plan_pins_the_moments_of_fp32_blocks_updated_on_the_gpu_and_counts_their_buffers():
    from transformers import LlamaConfig

    from lightning_slide.planner import ModelShape, Plan, Setup
    from tests.runtime.test_planner import LLAMA_8B

    shape = ModelShape.from_config(LlamaConfig(**LLAMA_8B))
    block = shape.units[1].trainable
    entries = {e.what: e for e in Plan.static(shape, Setup(SlideConfig(gpu_update_blocks=4), device="cuda")).entries}
    locked = entries["Adam exp_avg + exp_avg_sq (fp32) of the 4 blocks updated on the GPU"]
    assert locked.where == "pinned" and locked.bytes == 4 * 8 * block
    assert entries["Adam exp_avg + exp_avg_sq (fp32)"].bytes == 8 * shape.trainable - locked.bytes
    buffers = entries["fp32 moments' update buffers (2 chunks)"]
    assert buffers.bytes == device_update.DeviceUpdater.bytes_for(block, 1 << 22, "fp32", False, plane_bits=32)
    assert buffers.remedy == "gpu_update_blocks=0"  # named if refused


def test_the_plan_pins_compact_moments_and_counts_the_gpu_buffers_where_updates_run_there():
    from transformers import LlamaConfig

    from lightning_slide.planner import ModelShape, Plan, Setup
    from tests.runtime.test_planner import LLAMA_8B

    shape = ModelShape.from_config(LlamaConfig(**LLAMA_8B))
    for device, where in (("cuda", "pinned"), ("cpu", "ram")):
        plan = Plan.static(shape, Setup(SlideConfig(moment_precision="int8"), device=device))
        entries = {e.what: e for e in plan.entries}
        assert entries["Adam exp_avg + exp_avg_sq (int8)"].where == where
        buffers = entries.get("int8 moments' update buffers (4 chunks)")
        if device == "cuda":
            assert buffers.where == "gpu" and buffers.bytes == device_update.DeviceUpdater.bytes_for(
                128256 * 4096, 1 << 16, "int8", device_update.code_kernels_on(torch.device("cuda")), plane_bits=32)
            # with the kernels (triton on the GPU) the sets take 22 bytes an element, and 4 1/8 more with room for
            # the masters' planes; the torch ops' rows and noise more
            for bits, most in ((None, 23), (32, 27)):
                sets = device_update.DeviceUpdater.bytes_for(128256 * 4096, 1 << 16, "int8", True, bits)
                assert sets < 4 * most * device_update.CHUNK_ELEMS
        else:
            assert buffers is None
