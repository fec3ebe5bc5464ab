"""The disk tier trains exactly like the RAM tier, cleans up after itself, and refuses what cannot work."""

import copy
import errno
import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import LlamaConfig

import lightning_slide.planner as planner
import lightning_slide.tiers as tiers
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy
from lightning_slide.planner import ModelShape, Plan, PlanError, Resources, Setup, fit_moments
from lightning_slide.threads import Failure, WorkerError
from lightning_slide.tiers import DiskTierError, Region, Spill, TierDirectory
from tests.runtime.helpers import (
    CausalLM,
    EmbedsOutside,
    SkipsBatches,
    fit,
    param_groups,
    tiny_model,
    token_batches,
    trainer,
)
from tests.runtime.test_planner import SMALL

STEPS = 4


@pytest.fixture(params=["kvikio", "posix"])
def io_backend(request, monkeypatch):
    """Both I/O paths: kvikio (CI installs it with a stand-in libcuda) and the POSIX fallback."""
    if request.param == "posix":
        monkeypatch.setattr(tiers, "_kvikio", lambda: None)
    elif tiers._kvikio() is None:
        pytest.skip("kvikio is not installed with a loadable libcuda.so.1 here (.ci/run installs both)")
    return request.param


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def test_moments_on_disk_give_the_same_parameters_as_the_ram_tier(io_backend, tmp_path):
    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS)
    in_ram = fit(model, batches, SlideStrategy(chunk_elems=1024), STEPS)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0,
                                                chunk_elems=1024), STEPS)
    assert _same_parameters(in_ram.model, on_disk.model)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_deferred_updates_with_part_of_the_moments_on_disk_match_the_ram_tier(accumulate, io_backend, tmp_path):
    """Clipping defers updates to forward order: the read-ahead order follows."""
    model, batches = tiny_model("llama"), token_batches(STEPS * accumulate)
    in_ram = fit(model, batches, "slideformer", STEPS, accumulate=accumulate, clip=0.5)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=0.5),
                  STEPS, accumulate=accumulate, clip=0.5)
    assert _same_parameters(in_ram.model, on_disk.model)


def test_master_and_moments_on_disk_give_the_same_parameters_as_the_ram_tier(io_backend, tmp_path):
    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS)
    in_ram = fit(model, batches, SlideStrategy(chunk_elems=1024), STEPS)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0,
                                                nvme_master=True, chunk_elems=1024), STEPS)
    assert _same_parameters(in_ram.model, on_disk.model)
    assert _files(tmp_path) == []


def test_deferred_updates_with_half_the_master_on_disk_match_the_ram_tier(tmp_path):
    model, batches = tiny_model("llama"), token_batches(STEPS * 2)
    in_ram = fit(model, batches, "slideformer", STEPS, accumulate=2, clip=0.5)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=0.5,
                                                nvme_master=True), STEPS, accumulate=2, clip=0.5)
    assert _same_parameters(in_ram.model, on_disk.model)


def test_a_master_on_disk_keeps_frozen_parameters_and_amsgrad_state_like_the_ram_tier(tmp_path):
    model, batches = tiny_model("llama"), token_batches(STEPS)
    model.model.layers[1].mlp.requires_grad_(False)  # a frozen tail inside a unit whose master is on disk
    options = {"amsgrad": True}
    in_ram = fit(model, batches, "slideformer", STEPS, optimizer_kwargs=options)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0,
                                                nvme_master=True, chunk_elems=1024), STEPS, optimizer_kwargs=options)
    assert _same_parameters(in_ram.model, on_disk.model)
    assert torch.equal(on_disk.model.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


def test_bf16_loads_from_the_shadow_of_a_master_on_disk_match_the_ram_tier(tmp_path):
    """The pinned bf16 copy a disk master is loaded from rounds exactly as casting the RAM master does."""
    model, batches = tiny_model("mistral"), token_batches(STEPS)
    in_ram = fit(model, batches, "slideformer", STEPS, precision="bf16-mixed")
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0,
                                                nvme_master=True), STEPS, precision="bf16-mixed")
    assert _same_parameters(in_ram.model, on_disk.model)


def test_activations_on_disk_give_the_same_parameters_as_on_the_device(io_backend, tmp_path):
    model, batches = tiny_model("mistral"), token_batches(STEPS * 2)
    on_device = fit(model, batches, "slideformer", STEPS, accumulate=2)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), activations="nvme",
                                                nvme_moments=0.0), STEPS, accumulate=2)
    assert _same_parameters(on_device.model, on_disk.model)


def test_larger_inputs_get_larger_disk_regions_and_the_old_files_go(tmp_path):
    model = tiny_model("llama")
    batches = [x[:, :n] for x, n in zip(token_batches(3), (6, 16, 9))]
    on_device = fit(model, batches, "slideformer", 3)
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), activations="nvme", nvme_moments=0.0)
    on_disk = fit(model, batches, strategy, 3)
    assert _same_parameters(on_device.model, on_disk.model)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("master", [False, True], ids=["moments", "master-and-moments"])
def test_resuming_a_disk_tier_checkpoint_equals_an_uninterrupted_run(master, tmp_path):
    model, batches = tiny_model("qwen3"), token_batches(4)
    strategy = dict(offload="nvme", nvme_path=str(tmp_path / "nvme"), nvme_moments=1.0, nvme_master=master)
    straight = CausalLM(copy.deepcopy(model))
    every_2 = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer(SlideStrategy(**strategy), 6, default_root_dir=tmp_path, enable_checkpointing=True,
            callbacks=[every_2]).fit(straight, DataLoader(batches, batch_size=None))
    resumed = CausalLM(tiny_model("qwen3", seed=7))  # other weights: everything must come from the file
    trainer(SlideStrategy(**strategy), 6, default_root_dir=tmp_path).fit(
        resumed, DataLoader(batches, batch_size=None), ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert _same_parameters(straight.model, resumed.model)


def test_disk_files_are_removed_after_training(tmp_path):
    fit(tiny_model(), token_batches(2), SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0), 2)
    assert _files(tmp_path) == []


def test_disk_files_are_removed_after_an_exception(tmp_path):
    class Failing(CausalLM):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                assert _files(tmp_path), "the tier's files should exist while training"
                raise ValueError("injected failure in training_step")
            return super().training_step(batch, batch_idx)

    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0)
    with pytest.raises(ValueError, match="injected failure"):
        trainer(strategy, 3).fit(Failing(tiny_model()), DataLoader(token_batches(3), batch_size=None))
    assert _files(tmp_path) == []


def test_a_failing_disk_read_stops_training_with_its_error_and_the_files_go(tmp_path, monkeypatch):
    def broken(self, dst, offset):
        raise DiskTierError(f"injected read failure in {self.path}")

    monkeypatch.setattr(tiers.DiskFile, "read", broken)
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, activations="nvme")
    with pytest.raises(WorkerError, match="injected read failure"):
        trainer(strategy, 2).fit(CausalLM(tiny_model()), DataLoader(token_batches(2), batch_size=None))
    assert _files(tmp_path) == []


def test_an_unwritable_nvme_path_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    strategy = SlideStrategy(offload="nvme", nvme_path=str(blocker / "nvme"), nvme_moments=1.0)
    with pytest.raises(DiskTierError, match="not a writable directory"):
        trainer(strategy, 1).fit(CausalLM(tiny_model()), DataLoader(token_batches(1), batch_size=None))


def test_an_unwritable_nvme_path_is_the_error_a_placeholder_model_gets_too(tmp_path):
    """Setup fails before the engine fills the meta placeholders: the teardown must not hide why."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = trainer(SlideStrategy(offload="nvme", nvme_path=str(blocker / "nvme"), nvme_moments=1.0), 1)
    with run.init_module(empty_init=True):
        model = tiny_model()
    with pytest.raises(DiskTierError, match="not a writable directory"):
        run.fit(CausalLM(model), DataLoader(token_batches(1), batch_size=None))


def test_a_disk_without_room_for_the_plan_is_refused_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "available_disk", lambda path: 4096)
    monkeypatch.setattr(tiers, "TierDirectory", None)  # nothing may be created on disk
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0)
    with pytest.raises(PlanError, match="cannot fit this run in disk.*nvme_moments"):
        trainer(strategy, 1).fit(CausalLM(tiny_model()), DataLoader(token_batches(1), batch_size=None))


def test_a_micro_batch_whose_saved_inputs_do_not_fit_the_disk_is_refused_before_its_forward(tmp_path, monkeypatch):
    class DiskFillsUp(Callback):
        def on_train_start(self, trainer, pl_module):  # after setup's static check, before the first batch
            monkeypatch.setattr(planner, "available_disk", lambda path: 4096)

    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=0.0, activations="nvme")
    with pytest.raises(PlanError, match="cannot fit this run in disk.*saved part inputs.*smaller micro-batch"):
        trainer(strategy, 1, callbacks=[DiskFillsUp()]).fit(
            CausalLM(tiny_model()), DataLoader(token_batches(1), batch_size=None))


def test_evaluating_with_the_disk_tier_runs_and_logs_that_there_is_no_adam_state(tmp_path, caplog):
    batches = token_batches(2)
    with caplog.at_level("INFO"):
        (result,) = trainer(SlideStrategy(offload="nvme", nvme_path=str(tmp_path)), 1).validate(
            CausalLM(tiny_model()), DataLoader(batches, batch_size=None), verbose=False)
    assert result["val_loss"] > 0
    assert "no Adam state (evaluation)" in caplog.text


def test_each_fit_fits_the_disk_fraction_for_itself_and_leaves_the_strategys_setting_as_given(tmp_path):
    fitted = []

    class Fraction(Callback):
        def on_train_start(self, trainer, pl_module):
            fitted.append(trainer.strategy.engine.config.nvme_moments)

    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path))
    run, module = trainer(strategy, 1, callbacks=[Fraction()]), CausalLM(tiny_model())
    for steps in (1, 2):  # a second fit of the same Trainer: its setup plans again
        run.fit_loop.epoch_loop.max_steps = steps
        run.fit(module, DataLoader(token_batches(1), batch_size=None))
    assert fitted == [0.0, 0.0]  # all of a tiny model's moments fit in RAM
    assert strategy.config.nvme_moments is None


def test_a_disk_that_fills_up_while_preallocating_names_the_path_and_the_remedy(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match=f"{tmp_path}.*is full.*nvme_moments"):
        TierDirectory(str(tmp_path)).create("moments.bin", 1 << 20)
    assert _files(tmp_path) == []


def test_a_short_read_is_an_error_naming_the_file(io_backend, tmp_path):
    directory = TierDirectory(str(tmp_path))
    file = directory.create("state.bin", 8192)
    os.truncate(file.path, 4096)  # something else shortened it
    with pytest.raises(DiskTierError, match=f"Short read of {file.path}"):
        file.read(torch.empty(2048, dtype=torch.float32), 0)()
    directory.close()


def test_spill_reads_ahead_in_plan_order_and_writes_behind(io_backend, tmp_path):
    directory, failure = TierDirectory(str(tmp_path)), Failure()
    file = directory.create("data.bin", 4 * 4096)
    spill = Spill("test", 2, 4096, False, failure)
    spill.regions = {k: (Region(file, 4096 * k, 4096),) for k in range(4)}
    values = {k: torch.randn(1024) for k in range(4)}
    for k, v in values.items():
        buffer = spill.acquire()
        buffer.view(torch.float32).copy_(v)
        spill.write_back(k, buffer)
    spill.plan([2, 0, 3, 1])
    for k in [2, 0, 3, 1]:
        buffer = spill.take(k)
        assert torch.equal(buffer.view(torch.float32), values[k])
        spill.release(buffer)
    spill.plan([1])
    with pytest.raises(RuntimeError, match="out of the planned order"):
        spill.take(3)
    spill.close()
    directory.close()


@pytest.mark.parametrize("master", [False, True], ids=["moments", "master-and-moments"])
def test_the_plan_counts_the_disk_tier_byte_for_byte(master, tmp_path):
    model = tiny_model("qwen2-tied")
    config = SlideConfig(offload="nvme", nvme_path=str(tmp_path), nvme_moments=0.6, nvme_master=master,
                         chunk_elems=1024)
    optimizer = torch.optim.AdamW(param_groups(model))
    _, plan = planner.plan_for_run(model, optimizer, Setup(config, device="cpu", dtype=torch.float32))
    engine = SlideEngine(model, optimizer, config, torch.device("cpu"), torch.float32)
    assert plan.total("disk") == engine.tier.bytes > 0
    assert any(s.on_disk for s in engine.storages) == master
    buffers = sum(b.numel() for b in engine.moments.spill.buffers)
    in_ram = sum(4 * ((0 if s.on_disk else s.master.numel()) + (0 if s.index in engine.moments.on_disk
                                                                  else 2 * s.trainable_numel))
                 + (s.shadow.numel() * s.shadow.element_size() if s.shadow is not None else 0)
                 for s in engine.storages)
    host_state = sum(e.bytes for e in plan.entries if e.where == "ram" and any(
        word in e.what for word in ("master", "Adam", "read-ahead", "shadow")))
    assert host_state == in_ram + buffers
    engine.close()


def test_the_auto_fraction_puts_on_disk_only_what_ram_cannot_hold():
    model = tiny_model("llama")
    shape = ModelShape.from_model(model, {id(p) for p in model.parameters()})
    setup = Setup(SlideConfig(offload="nvme", chunk_elems=1024), device="cpu", dtype=torch.float32)
    everything = Plan.static(shape, setup).total("ram")
    assert fit_moments(shape, setup, Resources(ram=2 * everything)) == 0.0
    tight = fit_moments(shape, setup, Resources(ram=int(everything * 0.8), headroom=int(everything * 0.1)))
    assert 0 < tight < 1
    config = SlideConfig(offload="nvme", nvme_moments=tight, chunk_elems=1024)
    assert Plan.static(shape, Setup(config, device="cpu", dtype=torch.float32)).total("ram") <= 0.7 * everything


def test_with_the_master_on_disk_too_less_of_the_model_must_go_to_disk_to_fit_the_same_ram():
    shape = ModelShape.from_config(LlamaConfig(**SMALL))
    setups = [Setup(SlideConfig(offload="nvme", nvme_master=m, chunk_elems=1024)) for m in (False, True)]
    ram = Resources(ram=int(Plan.static(shape, setups[0]).total("ram", "pinned") * 0.6))
    moments_only, with_master = (fit_moments(shape, setup, ram) for setup in setups)
    assert 0 < with_master < moments_only < 1


def _fake_kvikio(monkeypatch, compat: bool) -> None:
    class Kvikio:
        __version__ = "26.10.00"

        class defaults:
            @staticmethod
            def is_compat_mode_preferred() -> bool:
                return compat

    monkeypatch.setattr(tiers, "_kvikio", lambda: Kvikio)


@pytest.mark.parametrize("compat", [True, False], ids=["compat-mode", "gds-machine"])
def test_the_log_names_the_io_path_the_tier_really_takes(compat, monkeypatch):
    _fake_kvikio(monkeypatch, compat)
    direct = tiers.direct_io("auto", torch.device("cuda"))
    name = tiers.backend_name(direct)
    assert name.startswith("kvikio 26.10.00")
    assert ("POSIX compatibility mode" in name) == compat == (not direct)
    assert ("GPUDirect Storage" in name) == direct
    assert name.endswith("activations staged in " + ("GPU memory" if direct else "pinned host memory"))


@pytest.mark.parametrize("setting, compat, device, direct", [
    ("auto", False, "cuda", True), ("auto", True, "cuda", False), ("auto", False, "cpu", False),
    ("on", True, "cuda", True), ("off", False, "cuda", False)])
def test_activations_move_device_memory_directly_only_where_gds_runs_or_when_asked(setting, compat, device, direct,
                                                                                 monkeypatch):
    _fake_kvikio(monkeypatch, compat)
    assert tiers.direct_io(setting, torch.device(device)) == direct


@pytest.mark.parametrize("kvikio, device, needs", [(True, "cpu", "CUDA compute device"), (False, "cuda", "kvikio")])
def test_gds_on_without_cuda_or_kvikio_is_a_clear_error(kvikio, device, needs, monkeypatch):
    if kvikio:
        _fake_kvikio(monkeypatch, compat=True)
    else:
        monkeypatch.setattr(tiers, "_kvikio", lambda: None)
    with pytest.raises(ValueError, match=f"gds='on' needs .*{needs}.*use gds='auto' or 'off'"):
        tiers.direct_io("on", torch.device(device))


@pytest.mark.parametrize("compat", [True, False], ids=["compat-mode", "gds-machine"])
def test_the_plan_puts_activation_staging_in_gpu_memory_with_direct_io(compat, monkeypatch):
    _fake_kvikio(monkeypatch, compat)
    shape = ModelShape.from_config(LlamaConfig(**SMALL))
    setup = Setup(SlideConfig(offload="nvme", activations="nvme"), device="cuda", dtype=torch.bfloat16)
    staging = [e for e in Plan.static(shape, setup).batch(shape, setup, 4, 256).entries if "staging" in e.what]
    assert [e.where for e in staging] == ["pinned" if compat else "gpu"]
    assert staging[0].bytes == 4 * 4 * 256 * SMALL["hidden_size"] * 2


def test_nvme_master_without_the_disk_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="nvme_master.*offload='nvme'"):
        SlideConfig(nvme_master=True)


def test_nvme_moments_without_the_disk_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="nvme_moments.*offload='nvme'"):
        SlideConfig(nvme_moments=0.5)


def test_a_skipped_step_keeps_its_planned_disk_reads_for_the_next_one(tmp_path):
    """training_step returning None skips a step: the reads planned for its updates serve the next step's."""
    from lightning.pytorch import Callback

    strategy, left = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, chunk_elems=4096), []

    class PlannedReadsAtTheEnd(Callback):
        def on_train_end(self, trainer, module):
            strategy.engine.synchronize()
            left.append(len(strategy.engine.moments.spill._expected))

    module = SkipsBatches(tiny_model("llama"), skip={1, 2})  # two skipped steps between two that update
    trainer(strategy, 4, callbacks=[PlannedReadsAtTheEnd()]).fit(module, DataLoader(token_batches(8), batch_size=None))
    assert left == [0]


def test_a_unit_on_disk_without_a_gradient_in_an_eager_step_is_refused_by_name(tmp_path):
    strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, chunk_elems=4096)
    with pytest.raises(RuntimeError, match=r"every trainable unit needs a gradient in each step, but \['embed'\]"):
        trainer(strategy, 2).fit(EmbedsOutside(tiny_model()), DataLoader(token_batches(2), batch_size=None))

