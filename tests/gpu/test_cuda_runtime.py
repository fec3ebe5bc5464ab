"""The runtime on a real GPU: streams, pinned memory, kernels; same answers, no allocation after warm-up."""

import importlib.util

import pytest
import torch

from lightning_slide import SlideConfig, SlideEngine
from lightning_slide.step_mode import StepMode
from lightning_slide.threads import Failure
from tests.runtime.helpers import (
    SEQ,
    VOCAB,
    fit,
    param_groups,
    reference,
    relative_difference,
    tiny_model,
    token_batches,
)

pytestmark = pytest.mark.gpu
STEPS = 5
NEEDS_KVIKIO = pytest.mark.skipif(importlib.util.find_spec("kvikio") is None,
                                  reason="gds='on' needs kvikio (the [nvme] extra)")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fp32_on_cuda_matches_adamw_without_kernels(accumulate):
    """With clipping: a window's first gradient lands in the pinned sums (accumulate=1: measured on the GPU)."""
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS * accumulate)
    expected = reference(model, batches, STEPS, accumulate=accumulate, clip=0.05, device="cuda")
    got = fit(model, batches, SlideStrategy(use_kernels=False), STEPS, accumulate=accumulate, clip=0.05,
              accelerator="gpu")
    assert relative_difference(expected, got.model) <= 1e-5


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_compact_moments_updated_on_the_gpu_train_as_the_cpu_pool_within_adamws_rounding(precision, clip,
                                                                                        monkeypatch):
    """The same fp32 run on CUDA twice: compact moments updated on the GPU (the default there) and by the CPU
    pool; only torch's CUDA and CPU fused AdamW kernels differ, in the last bits."""
    import lightning_slide.engine as engine_module
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS)
    runs = []
    for on_gpu in (True, False):
        if not on_gpu:
            monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: None)
        runs.append(fit(model, batches, SlideStrategy(use_kernels=False, moment_precision=precision), STEPS,
                        clip=clip, accelerator="gpu"))
    assert relative_difference(runs[1].model, runs[0].model) <= 1e-5


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_fp32_blocks_updated_on_the_gpu_match_adamw(clip, monkeypatch):
    """Two of the tiny model's blocks updated on the GPU, writing their new weights into their slots."""
    from lightning_slide import SlideStrategy
    from lightning_slide.device_update import DeviceUpdater

    updated, run = [], DeviceUpdater.run
    monkeypatch.setattr(DeviceUpdater, "run", lambda self, storage, *args: updated.append(storage.index) or run(
        self, storage, *args))
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, clip=clip, device="cuda")
    got = fit(model, batches, SlideStrategy(use_kernels=False, gpu_update_blocks=2), STEPS, clip=clip,
              accelerator="gpu")
    assert sorted(set(updated)) == [1, 3] and len(updated) == 2 * STEPS
    assert relative_difference(expected, got.model) <= 1e-5


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_fp32_blocks_keeping_their_moments_on_the_gpu_match_adamw(clip):
    """`resident_moments=2`: both GPU-updated blocks keep their moments in device memory after the first step."""
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, clip=clip, device="cuda")
    got = fit(model, batches, SlideStrategy(use_kernels=False, gpu_update_blocks=2, resident_moments=2), STEPS,
              clip=clip, accelerator="gpu")
    assert relative_difference(expected, got.model) <= 1e-5


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_moments_kept_on_the_gpu_beside_masters_as_planes_train_bit_for_bit_as_moments_in_ram(clip):
    """bf16-mixed, two block slots: the same run with the two GPU-updated blocks' moments in device memory and in
    pinned RAM."""
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS)
    runs = [fit(model, batches, SlideStrategy(use_kernels=False, gpu_update_blocks=2, slots=2, resident_moments=k),
                STEPS, clip=clip, precision="bf16-mixed", accelerator="gpu") for k in (2, 0)]
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_blocks_whose_updates_the_step_hides_go_back_to_the_cpu_and_the_run_matches_adamw(clip, monkeypatch):
    """`gpu_update_blocks="auto"` at the H200 machine's link and CPU rates, which give the GPU the embedding and
    some blocks, and a matmul rate at which any step hides every update: from the first micro-batch on, only the
    embedding's update runs on the GPU."""
    import lightning_slide.device_update as device_update
    from lightning_slide import SlideStrategy
    from lightning_slide.device_update import DeviceUpdater

    updated, run = [], DeviceUpdater.run
    monkeypatch.setattr(DeviceUpdater, "run", lambda self, storage, *args: updated.append(storage.index) or run(
        self, storage, *args))
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 1.0))
    model, batches = tiny_model("llama"), token_batches(STEPS)
    expected = reference(model, batches, STEPS, clip=clip, device="cuda")
    got = fit(model, batches, SlideStrategy(use_kernels=False), STEPS, clip=clip, accelerator="gpu")
    assert set(updated) == {0} and len(updated) == STEPS
    assert relative_difference(expected, got.model) <= 1e-5


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"], ids=["fp32-masters", "bf16-planes"])
def test_untouched_rows_updated_ahead_on_cuda_train_bit_for_bit_as_the_whole_table(precision, clip, monkeypatch):
    """The embedding's update on the GPU (at the H200 machine's rates, with every block's hidden by the step),
    steps whose tokens touch some of its rows (clipped ones hold the gradient on the host): the parameters of the
    same run with the staging refused, which updates the whole table at each step's end."""
    import lightning_slide.device_update as device_update
    import lightning_slide.touched_rows as touched_rows
    from lightning_slide import SlideStrategy
    from lightning_slide.device_update import DeviceUpdater

    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 1.0))
    ahead, run = [], DeviceUpdater.run_untouched
    monkeypatch.setattr(DeviceUpdater, "run_untouched", lambda self, *args: ahead.append(1) or run(self, *args))
    model, batches, runs = tiny_model("llama"), token_batches(STEPS), []
    for share in (touched_rows.RAM_SHARE, 1 << 62):
        monkeypatch.setattr(touched_rows, "RAM_SHARE", share)
        runs.append(fit(model, batches, SlideStrategy(use_kernels=False), STEPS, clip=clip, precision=precision,
                        accelerator="gpu"))
    assert len(ahead) == STEPS - 1  # from the second step on: the staging is reserved after the first
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)


def test_a_staging_grown_on_cuda_for_a_later_step_trains_bit_for_bit_as_the_whole_table(monkeypatch):
    """A first batch of 4 tokens stages 5 rows; the later ones touch more, and the updater's thread grows the
    pinned staging before their passes: every step after the first goes ahead, as the run with the staging refused
    updates whole."""
    import lightning_slide.device_update as device_update
    import lightning_slide.touched_rows as touched_rows
    from lightning_slide import SlideStrategy
    from lightning_slide.touched_rows import TouchedRows

    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 1.0))
    went, touched = [], TouchedRows.touched

    def counted(self: TouchedRows) -> torch.Tensor | None:
        rows = touched(self)
        went.append(rows is not None)
        return rows

    monkeypatch.setattr(TouchedRows, "touched", counted)
    model, batches, runs = tiny_model("llama"), token_batches(STEPS), []
    batches[0] = batches[0][:, :2]
    for share in (touched_rows.RAM_SHARE, 1 << 62):
        monkeypatch.setattr(touched_rows, "RAM_SHARE", share)
        runs.append(fit(model, batches, SlideStrategy(use_kernels=False), STEPS, precision="bf16-mixed",
                        accelerator="gpu"))
    assert went == [True] * (STEPS - 1)  # the refused run has no staging to ask
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision, blocks", [("int8", 0), ("fp32", 2)], ids=["int8", "fp32-2-blocks"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clipped"])
def test_masters_as_planes_on_cuda_train_as_whole_masters(precision, blocks, clip, monkeypatch):
    """bf16-mixed, two block slots (the window gives up slots that updates wrote the newest weights into), the
    compiled split and join: the parameters of the same run with the masters moved whole."""
    from lightning_slide import SlideStrategy, master_halves

    model, batches = tiny_model("llama"), token_batches(STEPS)
    from lightning_slide.device_update import DeviceUpdater

    converted, convert = [], DeviceUpdater.convert
    monkeypatch.setattr(DeviceUpdater, "convert",
                        lambda self, units, planes, step=0: converted.append(planes) or convert(self, units, planes,
                                                                                                step))
    runs = []
    for planes in (True, False):
        if not planes:
            assert converted  # the first run's masters were planes
            monkeypatch.setattr(master_halves, "plane_bits", lambda *args: None)
        strategy = SlideStrategy(use_kernels=False, moment_precision=precision, gpu_update_blocks=blocks, slots=2)
        runs.append(fit(model, batches, strategy, STEPS, clip=clip, precision="bf16-mixed", accelerator="gpu"))
    assert relative_difference(runs[1].model, runs[0].model) <= 1e-6


def test_24_bit_masters_on_cuda_train_near_the_32_bit_run_with_their_low_bytes_zero():
    """bf16-mixed, 8-bit moments, two block slots, the compiled split with its noise: the masters keep 24 bits,
    and after 5 steps at lr 3e-3 the parameters are within 1e-2 (relative; the tiny model's runs on the CPU, where
    both are deterministic, end 1.8e-3 apart) of the exact-master run's."""
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS)
    runs = [fit(model, batches, SlideStrategy(use_kernels=False, moment_precision="int8", slots=2, master_bits=bits),
                STEPS, precision="bf16-mixed", accelerator="gpu") for bits in (32, 24)]
    assert all((p.detach().float().view(torch.int32) & 0xFF == 0).all() for p in runs[1].model.parameters())
    assert 0 < relative_difference(runs[1].model, runs[0].model, per_tensor_limit=5e-2) <= 1e-2


def test_the_update_rates_are_measured_once_per_device():
    from lightning_slide.device_update import measured_rates

    rates = measured_rates(torch.device("cuda"))
    assert rates is measured_rates(torch.device("cuda", torch.cuda.current_device()))
    assert rates.cpu_elems_s > 1e8 and rates.link_bytes_s > 1e9  # a fused CPU AdamW, PCIe both ways
    assert 1e13 < rates.gpu_flops_s < 5e15  # a bf16 matmul: tens of teraflops or more, below any GPU's peak


@pytest.mark.parametrize("rows, activations", [(2, "auto"), (32, "cpu")], ids=["own-buffers", "saved-input-buffers"])
def test_held_bf16_gradients_on_cuda_train_exactly_as_fp32_sums_of_the_same_gradients(rows, activations):
    """A clipped step holds bf16 gradients copied straight from the GPU (into buffers of their own, or into the
    pinned buffers their units' saved inputs just left); widened they equal fp32 sums."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS, batch=rows)
    runs = [fit(model, batches, SlideStrategy(use_kernels=False, activations=activations), STEPS, clip=0.05,
                precision="bf16-mixed", accelerator="gpu", callbacks=callbacks)
            for callbacks in ([], [GradientAccumulationScheduler({0: 1, 1000: 2})])]
    assert all(torch.equal(p, q) for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters()))


@pytest.mark.parametrize(
    "settings",
    [dict(offload="nvme", nvme_moments=1.0, activations="nvme", chunk_elems=4096),
     pytest.param(dict(offload="nvme", nvme_moments=1.0, activations="nvme", gds="on", chunk_elems=4096),
                  marks=NEEDS_KVIKIO),
     dict(offload="nvme", nvme_moments=0.5, nvme_master=True, chunk_elems=4096), dict(slots="auto"),
     dict(recompute="never", slots=2)],
    ids=["disk-tier", "disk-tier-direct-io", "master-on-disk", "auto-window", "kept-graphs-two-slots"],
)
def test_every_tier_and_window_on_cuda_gives_the_cpu_tiers_parameters(settings, tmp_path):
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama", num_hidden_layers=6), token_batches(STEPS * 2)
    cpu_updates = dict(gpu_update_blocks=0)  # bit for bit: the disk tier's units are updated on the CPU
    base = fit(model, batches, SlideStrategy(use_kernels=False, recompute="always", **cpu_updates), STEPS,
               accumulate=2, accelerator="gpu")
    if settings.get("offload") == "nvme":
        settings = {**settings, "nvme_path": str(tmp_path)}
    other = fit(model, batches, SlideStrategy(use_kernels=False, **cpu_updates, **settings), STEPS, accumulate=2,
                accelerator="gpu")
    assert all(torch.equal(p, q) for p, q in zip(base.model.parameters(), other.model.parameters()))


@pytest.mark.parametrize("activations", ["device", "cpu"])
def test_bf16_on_cuda_with_kernels_stays_within_bf16_noise(activations):
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama"), token_batches(STEPS)
    fp32 = reference(model, batches, STEPS, device="cuda")
    lightning_bf16 = fit(model, batches, "auto", STEPS, precision="bf16-mixed", accelerator="gpu")
    ours = fit(model, batches, SlideStrategy(activations=activations), STEPS, precision="bf16-mixed", accelerator="gpu")
    noise = relative_difference(fp32, lightning_bf16.model, per_tensor_limit=0.1)
    assert relative_difference(fp32, ours.model, per_tensor_limit=0.1) <= max(2 * noise, 1e-3)


def _train(engine: SlideEngine, model, batches) -> None:
    for x in batches:
        engine.new_micro_batch()
        engine.begin_step()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        engine.end_step()


@pytest.mark.parametrize(
    "settings",
    [dict(activations="device", recompute="always"), dict(activations="cpu", recompute="always"),
     dict(slots="auto", recompute="always"), dict(recompute="auto"),
     pytest.param(dict(offload="nvme", activations="nvme", gds="on", recompute="always"), marks=NEEDS_KVIKIO)],
    ids=["device", "cpu", "auto-window", "auto-window-and-graphs", "disk-direct-io"])
def test_no_device_allocation_after_warm_up(settings, tmp_path):
    model = tiny_model("llama", num_hidden_layers=6)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    config = SlideConfig(**settings, **({"nvme_path": str(tmp_path)} if "offload" in settings else {}))
    engine = SlideEngine(model, opt, config, torch.device("cuda"), torch.bfloat16)
    batches = [x.cuda() for x in token_batches(6)]
    _train(engine, model, batches[:2])
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    _train(engine, model, batches[2:])
    engine.synchronize()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    kept = engine.stats()["kept_graphs"]
    engine.close()
    assert (kept > 0) == (settings.get("recompute") == "auto"), "recompute='auto' keeps graphs on a roomy GPU"
    assert after["segment.all.allocated"] == before["segment.all.allocated"], "cudaMalloc after warm-up"
    assert after["num_alloc_retries"] == before["num_alloc_retries"]


@NEEDS_KVIKIO
def test_direct_disk_io_moves_activations_between_gpu_memory_and_files_without_pcie_staging(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    config = SlideConfig(offload="nvme", activations="nvme", gds="on", nvme_path=str(tmp_path))
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model)), config, torch.device("cuda"), torch.bfloat16)
    _train(engine, model, [x.cuda() for x in token_batches(2)])
    engine.synchronize()
    stats, store = engine.stats(), engine.activations
    assert all(b.is_cuda for b in store.disk.buffers)
    assert stats["disk_write_bytes"] > 0 and stats["disk_read_bytes"] > 0
    assert store.bytes_out == store.bytes_in == 0, "activations took the pinned host path"
    engine.close()


def test_auto_recompute_keeps_graphs_after_the_first_step_with_the_same_parameters():
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama", num_hidden_layers=6), token_batches(STEPS)
    recomputed = fit(model, batches, SlideStrategy(use_kernels=False, recompute="always"), STEPS, accelerator="gpu")
    auto = SlideStrategy(use_kernels=False, recompute="auto")
    kept = []
    auto.teardown = lambda: (kept.append(auto.engine.stats()["kept_graphs"]), SlideStrategy.teardown(auto))
    got = fit(model, batches, auto, STEPS, accelerator="gpu")
    assert all(torch.equal(p, q) for p, q in zip(recomputed.model.parameters(), got.model.parameters()))
    assert kept[0] >= (STEPS - 1) * 6  # every block of every step after the first


def test_micro_batches_of_changing_size_give_the_parameters_of_a_fixed_window_that_recomputes():
    """A larger micro-batch shrinks the grown window and revokes kept graphs mid-run (while loads may still be
    copying into the slots it frees), then both grow again: the numbers must not notice."""
    from lightning_slide import SlideStrategy

    model, g = tiny_model("llama", num_hidden_layers=6), torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for rows in (1, 1, 3, 2, 3, 1)]
    fixed = fit(model, batches, SlideStrategy(use_kernels=False, slots=3, recompute="always"), len(batches),
                accelerator="gpu")
    adaptive = fit(model, batches, SlideStrategy(use_kernels=False), len(batches), accelerator="gpu")
    assert all(torch.equal(p, q) for p, q in zip(fixed.model.parameters(), adaptive.model.parameters()))


def test_master_weights_and_gradient_sums_are_pinned_and_unpinned_at_close():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(), torch.device("cuda"),
                         torch.bfloat16, StepMode(accumulates=True, clip_norm=1.0))
    assert all(s.pinned and s.acc_pinned for s in engine.storages)
    engine.close()
    assert not any(s.pinned or s.acc_pinned for s in engine.storages)


def test_landing_buffers_and_disk_masters_shadows_are_locked_at_their_own_size_and_unlocked_at_close(tmp_path):
    """Not through the caching host allocator, which would round each up to a power of two the plan does not
    count."""
    model = tiny_model("llama")
    config = SlideConfig(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, nvme_master=True)
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), config, torch.device("cuda"), torch.bfloat16)
    ring, shadows = engine.pump.ring, [s for s in engine.storages if s.shadow is not None]
    assert shadows and all(s.shadow_pinned and s.shadow.is_pinned() for s in shadows)
    assert all(b.is_pinned() for b in ring.buffers)
    engine.close()
    assert not any(s.shadow_pinned or s.shadow.is_pinned() for s in shadows)
    assert not any(b.is_pinned() for b in ring.buffers)


def test_host_buffers_allocated_one_after_another_all_page_lock():
    """Small buffers side by side in the heap would share pages, and the runtime refuses a page locked twice."""
    from lightning_slide.pinned import host_empty, pin_, unpin_

    buffers = [host_empty(1000 + i) for i in range(64)]
    assert all(pin_(b) and b.is_pinned() for b in buffers)
    for b in buffers:
        unpin_(b)


def test_a_refused_page_lock_leaves_the_buffer_pageable_and_the_next_kernel_launch_unharmed():
    from lightning_slide.pinned import host_empty, pin_, unpin_

    buffer = host_empty(1000)
    assert pin_(buffer)
    assert not pin_(buffer)  # already locked: cudaErrorHostMemoryAlreadyRegistered
    assert torch.equal(torch.ones(4, device="cuda") * 2, torch.full((4,), 2.0, device="cuda"))
    unpin_(buffer)


def test_the_fused_loss_takes_its_buffer_budget_from_the_config():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(loss_chunk_mib=256),
                         torch.device("cuda"), torch.bfloat16)
    assert model.lm_head.chunk_mib == 256
    engine.close()


def test_a_prefetched_input_waits_for_queued_compute_on_the_memory_it_is_given():
    """The caching allocator hands a prefetch the block of a tensor freed in the host's order while a kernel
    queued behind a long one still reads it: the copy on the h2d lane must not overwrite it first."""
    from lightning_slide.activations import ActivationStore
    from lightning_slide.streams import Lane

    device, n = torch.device("cuda"), 16 << 20
    store = ActivationStore("cpu", device, Lane(device, False), Lane(device, True), Lane(device, True), saves=1,
                            failure=Failure(None))
    saved = store.save("block.0", torch.zeros(n, device=device, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    x = torch.ones(n, device=device, dtype=torch.bfloat16)
    torch.cuda._sleep(100_000_000)  # the compute stream is busy for tens of milliseconds
    doubled = x * 2  # queued behind it: reads x later
    block = x.data_ptr()
    del x
    saved.prefetch()
    assert saved._value.data_ptr() == block  # the hazard is set up: the prefetch got x's block
    torch.cuda.synchronize()
    assert bool((doubled == 2).all())
    store.close()


def test_saved_inputs_wait_in_ram_pinned_at_their_own_size_reused_while_they_fit_and_unpinned_at_close():
    from lightning_slide.activations import ActivationStore
    from lightning_slide.streams import Lane

    device = torch.device("cuda")
    store = ActivationStore("cpu", device, Lane(device, False), Lane(device, True), Lane(device, True), saves=1,
                            failure=Failure(None))
    odd = torch.randn(3, 1000, 5, device=device, dtype=torch.bfloat16)  # 30,000 bytes: no power of two
    saved = store.save("block.0", odd)
    buf = store._pool["block.0"]
    assert buf.pinned and buf.raw.is_pinned() and buf.raw.numel() == odd.numel() * 2
    assert torch.equal(saved.get(), odd)
    smaller = torch.randn(2, 1000, 5, device=device, dtype=torch.bfloat16)
    assert torch.equal(store.save("block.0", smaller).get(), smaller) and store._pool["block.0"] is buf
    store.close()
    assert not buf.pinned and not buf.raw.is_pinned()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("grad_on", ["cuda", "cpu"], ids=["eager-gradient-on-the-gpu", "held-gradient-on-the-host"])
def test_compact_moments_updated_on_the_gpu_equal_decode_then_torch_cuda_adamw_then_encode(precision, grad_on,
                                                                                          monkeypatch):
    """Chunks of 2,048 elements over pieces of 1,024: the device updater's result is torch.optim.AdamW(fused=True)
    on CUDA over the decoded moments, encoded again, bit for bit."""
    import lightning_slide.device_update as device_update
    import lightning_slide.layer_adam as layer_adam
    from lightning_slide.device_update import DeviceUpdater
    from lightning_slide.layer_adam import DeferredUpdate, DeviceGrad, LayerAdam, snapshot
    from tests.runtime import test_compact_moments as compact

    monkeypatch.setattr(layer_adam, "SCRATCH_ELEMS", 1024)
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 2048)
    params, optimizer, storage, cpu_adam = compact._unit(precision)
    cpu_adam.stop()
    cpu_adam.close()
    moments = cpu_adam.moments
    updater = DeviceUpdater(torch.device("cuda"), moments.codecs, storage.trainable_numel, 1024)
    updater.serve([storage], {storage.index})
    adam = LayerAdam([storage], moments, Failure(None), updater)
    grad = torch.randn(storage.trainable_numel, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    master, moments_after = compact._reference_step(storage, optimizer, grad.float(), precision, step=4, device="cuda")
    plan = snapshot(optimizer, 4, None)
    item = DeviceGrad(0, grad.cuda(), None, plan, lambda event: None) if grad_on == "cuda" else (
        DeferredUpdate(0, plan, grad))
    compact.run_and_compare(adam, item, storage, master, moments_after)


def test_a_validate_of_its_own_on_cuda_gives_the_plain_models_per_token_loss():
    """`trainer.validate` without a fit: the module's metric states follow the compute device there too."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_slide.lm import CausalLMModule

    model, batches = tiny_model("llama"), token_batches(2)
    with torch.no_grad():
        expected = torch.stack([model.cuda()(input_ids=x.cuda(), labels=x.cuda()).loss for x in batches]).mean()
    module = CausalLMModule(model.cpu())
    run = Trainer(strategy="slideformer", accelerator="gpu", devices=1, logger=False, enable_progress_bar=False)
    loader = DataLoader([{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in batches],
                        batch_size=None)
    (metrics,) = run.validate(module, loader, verbose=False)
    assert metrics["val/loss"] == pytest.approx(float(expected), rel=1e-4)
