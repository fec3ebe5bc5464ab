"""Masters as planes (`master_halves`): the units the GPU updates in a bf16 run keep their fp32 master as a weights
plane, the low halves and the parities while they train. On the CPU (standing in for the GPU, as in
test_device_update) they train bit for bit as the CPU pool trains whole masters, whatever the window gives up when,
and the parameters are fp32 masters again whenever the state is read."""

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_slide.device_update as device_update
import lightning_slide.engine as engine_module
import lightning_slide.planner as planner
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy, StepMode, master_halves
from lightning_slide.planner import ModelShape, Plan, Setup
from tests.runtime.helpers import CausalLM, assert_same_state, param_groups, tiny_model, token_batches, trainer

MODES = [StepMode(), StepMode(clip_norm=0.05), StepMode(accumulates=True), StepMode(accumulates=True, clip_norm=0.05)]
MODE_IDS = ["eager", "clipped", "accumulated", "accumulated-clipped"]


def _engine(on_device: bool, precision: str, mode: StepMode, monkeypatch, slots: int | str = 2,
            arch: str = "qwen2-tied", master_bits: int = 32) -> tuple[SlideEngine, torch.nn.Module]:
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device if on_device else None)
    model = tiny_model(arch)
    config = SlideConfig(moment_precision=precision, slots=slots, gpu_update_blocks=2 if precision == "fp32" else 0,
                         chunk_elems=1024, master_bits=master_bits)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config, torch.device("cpu"),
                         torch.bfloat16, mode)
    return engine, model


def _steps(engine: SlideEngine, model: torch.nn.Module, steps: int, accumulate: int = 1,
           batches: list[torch.Tensor] | None = None) -> None:
    """bf16-mixed steps through the engine's protocol, with no synchronize between them (as in a fit)."""
    batches = token_batches(steps * accumulate) if batches is None else batches
    for i in range(0, len(batches), accumulate):
        for k, x in enumerate(batches[i : i + accumulate]):
            engine.new_micro_batch()
            if k == accumulate - 1:
                engine.begin_step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=x, labels=x).loss.backward()
        engine.end_step()



@pytest.mark.parametrize("slots", [2, 8], ids=["blocks-slide", "all-resident"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("precision", ["int8", "bf16", "fp32"], ids=["int8", "bf16", "fp32-2-of-3-blocks"])
def test_masters_as_planes_train_bit_for_bit_as_whole_masters_on_the_cpu(precision, mode, slots, monkeypatch):
    """Several chunks a unit (1,024 elements), the window giving up slots whose units' newest weights only they hold
    (2 slots) or keeping every block; a tied embedding; accumulation lands its sums without a slot to write."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(device_update, "code_kernels_on", lambda device: False)  # the torch ops
    accumulate = 2 if mode.accumulates else 1
    runs = [_engine(on, precision, mode, monkeypatch, slots) for on in (False, True)]
    for engine, model in runs:
        _steps(engine, model, 3, accumulate)
    planes = runs[1][0]
    gpu = planes.adam.on_device.units
    assert {s.index for s in planes.storages if s.halves is not None} == gpu
    assert all(s.halves.planes for s in planes.storages if s.halves is not None)
    for engine, _ in runs:
        engine.synchronize()
    assert not any(s.halves.planes for s in planes.storages if s.halves is not None)
    assert_same_state(runs[0][0], planes)
    for engine, _ in runs:
        engine.close()


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_the_kernels_planes_train_bit_for_bit_as_the_torch_ops(mode, monkeypatch):
    """`ops.master_halves` (here in Triton's interpreter) splits and joins every chunk in the updater."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    runs = [_engine(on, "int8", mode, monkeypatch) for on in (False, True)]
    assert runs[1][0].adam.on_device.planes.__name__ == "lightning_slide.ops.master_halves"
    for engine, model in runs:
        _steps(engine, model, 3)
        engine.synchronize()
    assert_same_state(runs[0][0], runs[1][0])
    for engine, _ in runs:
        engine.close()


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_blocks_whose_updates_the_first_micro_batch_hides_go_back_to_the_cpu_as_whole_masters(mode, monkeypatch):
    """`gpu_update_blocks="auto"` at the H200 machine's link and CPU rates and a matmul rate that makes any step's
    compute hide every update: an evaluation first turns the GPU's units into planes (as Lightning's sanity check
    does), then the first training micro-batch gives the blocks back to the CPU, whole masters again, and keeps the
    embedding's update on the GPU. The run trains bit for bit as the CPU pool."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(device_update, "code_kernels_on", lambda device: False)
    monkeypatch.setattr(device_update, "measured_rates", lambda device: device_update.UpdateRates(3.1e9, 72e9, 1.0))
    runs = []
    for on in (False, True):
        monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device, on=on: device if on else None)
        model = tiny_model("llama")
        engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                             SlideConfig(slots=2, chunk_elems=1024), torch.device("cpu"), torch.bfloat16, mode)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=token_batches(1, seed=2)[0])
        runs.append(engine)
        if on:
            given = engine.adam.on_device.units
            assert 0 in given and len(given) > 1 and all(engine.storages[u].halves.planes for u in given)
        for x in token_batches(3):
            engine.new_micro_batch(x.numel())
            engine.begin_step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=x, labels=x).loss.backward()
            engine.end_step()
        engine.synchronize()
    fitted = runs[1]
    assert fitted.adam.on_device.units == {0}
    assert [s.index for s in fitted.storages if s.halves is not None] == [0]
    assert any("GPU for micro-batches of" in note and ": 1 of the" in note for note in fitted.notes)
    assert_same_state(runs[0], fitted)
    for engine in runs:
        engine.close()


@pytest.mark.parametrize("slots", [2, 8], ids=["blocks-slide", "all-resident"])
def test_after_a_failed_update_closing_turns_the_planes_back_into_fp32_masters(slots, monkeypatch):
    """The updater fails in the second step: the error comes out, and closing still joins every master (each
    unit as its last update left it, none a plane's bytes read as fp32)."""
    from lightning_slide.threads import WorkerError

    engine, model = _engine(True, "int8", StepMode(), monkeypatch, slots=slots)
    _steps(engine, model, 1)
    engine.synchronize()
    before = [s.master.clone() for s in engine.storages]
    _steps(engine, model, 1)  # planes again, from its first forward
    chunk, calls = device_update.DeviceUpdater._chunk, []

    def fails_midway(self, *args, **kwargs):
        calls.append(None)
        if len(calls) > 2:
            raise FloatingPointError("injected failure in the GPU update")
        return chunk(self, *args, **kwargs)

    monkeypatch.setattr(device_update.DeviceUpdater, "_chunk", fails_midway)
    with pytest.raises(WorkerError, match="injected failure"):
        _steps(engine, model, 2)
        engine.synchronize()
    engine.close()
    assert not any(s.halves.planes for s in engine.storages if s.halves is not None)
    assert all((s.master - b).abs().max() < 0.1 for s, b in zip(engine.storages, before))


def test_a_slot_given_up_is_written_back_to_its_plane_before_it_takes_another_unit(monkeypatch):
    """Two slots for three blocks: each forward gives up slots that updates wrote the newest weights into."""
    engine, model = _engine(True, "int8", StepMode(), monkeypatch, slots=2, arch="llama")
    _steps(engine, model, 3)
    assert engine.window.written_back_bytes > 0
    assert engine.stats()["d2h_weights_back_bytes"] == engine.window.written_back_bytes
    engine.close()


def test_a_resident_units_update_moves_its_low_halves_and_parities_and_leaves_its_weights_in_the_slot(monkeypatch):
    """Every unit has a slot: per element of master 2 bytes and a parity bit each way, instead of fp32's 4."""
    runs = [_engine(True, "int8", StepMode(), monkeypatch, slots=8)]
    monkeypatch.setattr(master_halves, "plane_bits", lambda *args: None)
    runs.append(_engine(True, "int8", StepMode(), monkeypatch, slots=8))
    for engine, model in runs:
        _steps(engine, model, 2)
        engine.drain()
    planes, whole = (engine for engine, _ in runs)
    assert not any(s.halves is not None for s in whole.storages)
    saved_a_way = sum(4 * s.trainable_numel - (2 * s.trainable_numel + master_halves.parity_bytes(s.trainable_numel))
                      for s in planes.storages)  # one chunk a unit
    moved = [e.adam.on_device.bytes_up + e.adam.on_device.bytes_down for e in (planes, whole)]
    assert moved[1] - moved[0] == 2 * 2 * saved_a_way  # two steps, up and back
    assert planes.window.written_back_bytes == 0  # no slot was given up
    planes.close(), whole.close()


def test_a_unit_whose_master_is_planes_loads_its_bf16_weights_plane_without_a_cast(monkeypatch):
    engine, model = _engine(True, "int8", StepMode(), monkeypatch, slots=2, arch="llama")
    _steps(engine, model, 1)
    engine.drain()
    window, block = engine.window, engine.storages[2]
    window.shrink(0)  # every slot given up: written back where an update left the newest weights there
    window.grow(1)
    before = window.load_bytes[2]
    slot = window.ensure(2, 2, 1, set())
    assert window.load_bytes[2] - before == 2 * block.numel
    assert torch.equal(slot.params[: block.numel], _weights(block.halves))
    engine.synchronize()
    assert torch.equal(slot.params[: block.numel], block.master.to(torch.bfloat16))
    engine.close()


def _weights(halves: master_halves.MasterHalves) -> torch.Tensor:
    return torch.cat([weights for _, weights, _ in halves.pieces(0, halves.master.numel())])


def test_the_updater_turns_a_unit_into_planes_and_back_chunk_by_chunk_in_place(monkeypatch):
    """Chunks of 1,024 elements and a partial last one (not a whole parity byte): each chunk's weights and low halves
    in its own bytes, every master back exactly."""
    from lightning_slide.moment_codec import codecs
    from tests.ops.test_master_halves import _masters

    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    updater = device_update.DeviceUpdater(torch.device("cpu"), codecs("int8"), 4096, 256, code_kernels=False,
                                          plane_bits=32)
    master = _masters(5000 + 3, "cpu")
    master[torch.isnan(master)] = 0.25
    halves = master_halves.MasterHalves(master.clone(), updater.chunk)
    assert updater.chunk == 1024 and len(halves.chunks()) == 5
    updater.convert([halves], planes=True)
    assert halves.planes
    assert torch.equal(_weights(halves).view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    low = torch.cat([low for _, _, low in halves.pieces(0, master.numel())])
    assert torch.equal(low, master.view(torch.int32).to(torch.int16))
    updater.convert([halves], planes=False)
    assert not halves.planes and torch.equal(halves.master.view(torch.int32), master.view(torch.int32))


def test_a_piece_of_the_planes_never_crosses_a_chunk():
    halves = master_halves.MasterHalves(torch.arange(20, dtype=torch.float32), 8)
    pieces = [(at, weights.numel(), low.numel()) for at, weights, low in halves.pieces(5, 19)]
    assert pieces == [(5, 3, 3), (8, 8, 8), (16, 3, 3)]
    (_, weights, low), = halves.pieces(16, 20)  # the last chunk, 4 elements: its weights, then its low halves
    bits = halves.master.view(torch.int16)
    assert weights.data_ptr() == bits[32:].data_ptr() and low.data_ptr() == bits[36:].data_ptr()


def test_closing_without_a_synchronize_leaves_the_parameters_fp32_masters(monkeypatch):
    runs = [_engine(on, "int8", StepMode(), monkeypatch) for on in (False, True)]
    for engine, model in runs:
        _steps(engine, model, 2)
        engine.close()
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1].parameters(), runs[1][1].parameters()))


def test_a_fit_that_validates_and_checkpoints_every_step_trains_as_the_cpu_pool(tmp_path, monkeypatch):
    """bf16-mixed through Lightning: each checkpoint reads the state (the masters turn fp32 again), each validation
    loads the blocks, and the next step's forward turns them into planes again."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    model, batches = tiny_model("llama"), token_batches(4)
    runs = []
    for on_device in (False, True):
        monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device, on=on_device: device if on else None)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / str(on_device), every_n_train_steps=1, save_top_k=-1)
        module = CausalLM(copy.deepcopy(model))
        trainer(SlideStrategy(moment_precision="int8", slots=2), 4, precision="bf16-mixed", val_check_interval=2,
                limit_val_batches=1, callbacks=[checkpoints], enable_checkpointing=True).fit(
            module, DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None))
        runs.append(module)
    assert all(torch.equal(p, q) for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters()))
    saved = torch.load(tmp_path / "True" / "epoch=0-step=4.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[f"model.{name}"], p) for name, p in runs[1].model.named_parameters())


@pytest.mark.parametrize(
    "dtype, chunk, largest, applies",
    [(torch.bfloat16, 1024, 5000, True), (torch.bfloat16, 1028, 5000, False), (torch.bfloat16, 1028, 1000, True),
     (torch.float32, 1024, 5000, False), (torch.float16, 1024, 5000, False)],
    ids=["bf16", "chunks-inside-parity-bytes", "one-chunk-a-unit", "fp32", "fp16"])
def test_masters_train_as_planes_only_computing_in_bf16_on_whole_parity_bytes(dtype, chunk, largest, applies):
    assert master_halves.plane_bits(dtype, chunk, largest, 24) == (24 if applies else None)


def test_the_plan_counts_the_parity_planes_where_the_gpu_updates_in_bf16():
    from transformers import LlamaConfig

    from tests.runtime.test_planner import LLAMA_8B

    shape = ModelShape.from_config(LlamaConfig(**LLAMA_8B))
    for dtype, counted in ((torch.bfloat16, True), (torch.float32, False)):
        setup = Setup(SlideConfig(moment_precision="int8"), device="cuda", dtype=dtype)
        entries = {e.what: e for e in Plan.static(shape, setup).entries}
        parity = entries.get("parity planes of the masters the GPU updates (master_halves)")
        assert (parity is not None) == counted
        if counted:
            assert parity.where == "pinned"
            assert parity.bytes == sum(master_halves.parity_bytes(u.numel) for u in shape.units)


def test_a_run_resumed_from_its_checkpoint_with_masters_as_planes_equals_the_uninterrupted_run(tmp_path,
                                                                                               monkeypatch):
    """The checkpoint is written from fp32 masters; loading it writes fp32 masters, which turn into planes again."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    model, batches = tiny_model("qwen2-tied"), token_batches(4)

    def run(module: CausalLM, steps: int, root, ckpt_path=None, callbacks=()) -> None:
        trainer(SlideStrategy(moment_precision="int8", slots=2), steps, clip=1.0, precision="bf16-mixed",
                default_root_dir=root, enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(
            module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)

    straight = CausalLM(copy.deepcopy(model))
    run(straight, 6, tmp_path, callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed = CausalLM(tiny_model("qwen2-tied", seed=123))  # other weights: everything must come from the file
    run(resumed, 6, tmp_path / "resumed", ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))  # the epoch's end
    assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters()))


def test_fabric_with_masters_as_planes_trains_as_the_cpu_pool(monkeypatch):
    """`fabric.clip_gradients`, a state_dict read mid-run (the masters fp32 again) and more steps after it."""
    from lightning.fabric import Fabric

    from lightning_slide.fabric import SlideFabricStrategy
    from tests.test_fabric import Run

    model, batches = tiny_model("llama"), token_batches(4)
    runs = []
    for on_device in (False, True):
        monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device, on=on_device: device if on else None)
        fabric = Fabric(strategy=SlideFabricStrategy(moment_precision="int8", slots=2), accelerator="cpu", devices=1,
                        precision="bf16-mixed")
        run = Run(copy.deepcopy(model), fabric=fabric)
        run.train(batches[:2], clip=0.05)
        state = {k: v.clone() for k, v in run.model.state_dict().items()}
        run.train(batches[2:], clip=0.05)
        runs.append((state, run.close()))
    assert all(torch.equal(runs[0][0][k], runs[1][0][k]) for k in runs[0][0])
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1].parameters(), runs[1][1].parameters()))


def test_units_on_the_disk_tier_keep_whole_masters_beside_the_planes_of_the_others(tmp_path, monkeypatch):
    """offload="nvme": the units whose moments are on disk are updated by the CPU pool, the rest on the device."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    model = tiny_model("llama")
    runs = []
    for on_device in (False, True):
        monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device, on=on_device: device if on else None)
        copy_ = copy.deepcopy(model)
        config = SlideConfig(offload="nvme", nvme_path=str(tmp_path), nvme_moments=0.5, moment_precision="int8",
                             chunk_elems=1024, slots=2)
        engine = SlideEngine(copy_, torch.optim.AdamW(param_groups(copy_), lr=1e-2), config, torch.device("cpu"),
                             torch.bfloat16, StepMode())
        _steps(engine, copy_, 3)
        engine.synchronize()
        runs.append(engine)
    on_disk = runs[1].moments.on_disk
    assert on_disk and all((s.halves is None) == (s.index in on_disk) for s in runs[1].storages)
    assert_same_state(*runs)
    for engine in runs:
        engine.close()


class _StateEachStep(Callback):
    """What a callback reads of the module after each step: its state_dict."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.state_dict().items()})


def test_a_callback_reading_the_modules_state_dict_mid_fit_gets_the_fp32_masters(monkeypatch):
    model, batches = tiny_model("llama"), token_batches(3)
    seen = []
    for on_device in (False, True):
        monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device, on=on_device: device if on else None)
        callback = _StateEachStep()
        trainer(SlideStrategy(moment_precision="int8", slots=2), 3, precision="bf16-mixed", callbacks=[callback]).fit(
            CausalLM(copy.deepcopy(model)), DataLoader(batches, batch_size=None))
        seen.append(callback.states)
    assert len(seen[1]) == 3
    assert all(torch.equal(a[k], b[k]) for a, b in zip(*seen) for k in a)


def _round_to_24_bits(engine: SlideEngine, step: int, whole: bool) -> None:
    """What `master_bits=24` does to the masters the GPU updates, done here to whole fp32 masters: each rounded
    stochastically to 24 bits with the noise of `step` (whole masters at the first forward, else the range the
    update covered); the slots then load the rounded weights."""
    engine.drain()
    for s in engine.storages:
        n = s.numel if whole else s.trainable_numel
        bits = s.master[:n].view(torch.int32)
        bits.add_(master_halves.noise_bytes(0, n, master_halves.seed(step, s.index), bits.device)).bitwise_and_(-256)
    engine.window.reset()


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-ops", "kernels"])
def test_24_bit_masters_train_as_whole_masters_rounded_stochastically_after_each_update(kernels, monkeypatch):
    """The 24-bit run's updater against the CPU pool's whole fp32 masters, rounded by hand after each step with the
    same noise: bit for bit, with slots given up and loaded again, a tied embedding and several chunks a unit."""
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)
    if kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setattr(device_update, "code_kernels_on", lambda device: False)
    reference, reference_model = _engine(False, "int8", StepMode(), monkeypatch)
    planes, model = _engine(True, "int8", StepMode(), monkeypatch, master_bits=24)
    batches = token_batches(3)
    _round_to_24_bits(reference, 0, whole=True)
    for step, x in enumerate(batches, start=1):
        _steps(reference, reference_model, 1, batches=[x])
        _round_to_24_bits(reference, step, whole=False)
        _steps(planes, model, 1, batches=[x])
    for engine in (reference, planes):
        engine.synchronize()
    assert all((s.master.view(torch.int32) & 0xFF == 0).all() for s in planes.storages)
    assert_same_state(reference, planes)
    reference.close(), planes.close()


def test_a_24_bit_masters_update_moves_one_byte_of_low_part_instead_of_two(monkeypatch):
    runs = [_engine(True, "int8", StepMode(), monkeypatch, slots=8, master_bits=bits) for bits in (32, 24)]
    for engine, model in runs:
        _steps(engine, model, 2)
        engine.drain()
    moved = [e.adam.on_device.bytes_up + e.adam.on_device.bytes_down for e, _ in runs]
    assert moved[0] - moved[1] == 2 * 2 * sum(s.trainable_numel for s in runs[0][0].storages)  # 2 steps, 2 ways
    for engine, _ in runs:
        engine.close()


def test_24_bit_masters_are_refused_where_no_master_trains_as_planes(monkeypatch):
    with pytest.raises(ValueError, match="master_bits=24.*set master_bits=32"):
        _engine(False, "int8", StepMode(), monkeypatch, master_bits=24)  # no GPU updates: the CPU pool
    from transformers import LlamaConfig

    from tests.runtime.test_planner import LLAMA_8B

    shape = ModelShape.from_config(LlamaConfig(**LLAMA_8B))
    with pytest.raises(ValueError, match="master_bits=24"):  # fp32 compute: no planes (before any allocation)
        Plan.static(shape, Setup(SlideConfig(moment_precision="int8", master_bits=24), device="cuda",
                                 dtype=torch.float32))


def test_a_run_with_24_bit_masters_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """The checkpoint holds the rounded masters (their low 8 bits zero), which the resumed run's planes keep as
    they are; the noise of each later update is the uninterrupted run's (the step's and the unit's)."""
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device)
    monkeypatch.setattr(planner, "gpu_updates_on", lambda device: device)  # its check agrees with the engine
    model, batches = tiny_model("qwen2-tied"), token_batches(4)

    def run(module: CausalLM, steps: int, root, ckpt_path=None, callbacks=()) -> None:
        trainer(SlideStrategy(moment_precision="int8", slots=2, master_bits=24), steps, precision="bf16-mixed",
                default_root_dir=root, enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(
            module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)

    straight = CausalLM(copy.deepcopy(model))
    run(straight, 6, tmp_path, callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)])
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=False)["state_dict"]
    assert all((v.float().view(torch.int32) & 0xFF == 0).all() for v in saved.values() if v.is_floating_point())
    resumed = CausalLM(tiny_model("qwen2-tied", seed=123))
    run(resumed, 6, tmp_path / "resumed", ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters()))
