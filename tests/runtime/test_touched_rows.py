"""An untied embedding's rows that no token of the step touched are updated ahead of its gradient, on the device
updater (`touched_rows`): the whole table with a zero gradient beside the backward, the touched rows from their
staged state at the boundary. On the CPU (standing in for the GPU) training stays bit for bit as the CPU pool's."""

import math

import pytest
import torch

import lightning_slide.device_update as device_update
import lightning_slide.engine as engine_module
import lightning_slide.touched_rows as touched_rows
from lightning_slide import SlideConfig, SlideEngine, StepMode
from lightning_slide.master_halves import MasterHalves
from lightning_slide.touched_rows import TouchedRows, rows_of
from tests.runtime.helpers import assert_same_state, param_groups, tiny_model, token_batches

H200_RATES = device_update.UpdateRates(3.1e9, 72e9, 7e14)  # the embedding's update goes to the GPU there


def _engine(on_device: bool, dtype: torch.dtype, mode: StepMode, monkeypatch, arch: str = "llama",
            slots: int | str = "auto") -> tuple[SlideEngine, torch.nn.Module]:
    monkeypatch.setattr(engine_module, "gpu_updates_on", lambda device: device if on_device else None)
    monkeypatch.setattr(device_update, "CHUNK_ELEMS", 1024)  # 32 rows of the tiny models' 32 a chunk
    monkeypatch.setattr(device_update, "measured_rates", lambda device: H200_RATES)
    model = tiny_model(arch)
    config = SlideConfig(slots=slots, gpu_update_blocks="auto" if on_device else 0, chunk_elems=1024)
    engine = SlideEngine(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config, torch.device("cpu"),
                         dtype, mode)
    return engine, model


def _train(engine: SlideEngine, model: torch.nn.Module, dtype: torch.dtype, batches: list[torch.Tensor],
           accumulate: int = 1) -> None:
    """Steps as a fit takes them (no synchronize between them), then the state made whole."""
    for i, x in enumerate(batches):
        engine.new_micro_batch(x.numel())
        if i % accumulate == accumulate - 1:
            engine.begin_step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            model(input_ids=x, labels=x).loss.backward()
        if i % accumulate == accumulate - 1:
            engine.end_step()
    engine.synchronize()



MODES = {"eager": (StepMode(), 1), "clipped": (StepMode(clip_norm=0.05), 1),
         "accumulated-clipped": (StepMode(accumulates=True, clip_norm=0.05), 2)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("slots", ["auto", 2], ids=["resident", "blocks-slide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-masters", "bf16-planes"])
def test_untouched_rows_updated_ahead_train_bit_for_bit_as_the_whole_table_on_the_cpu(dtype, slots, mode,
                                                                                      monkeypatch):
    """Uniform random tokens touch some of the 97 rows in each step; with bf16 compute the master trains as planes
    (the touched rows' low plane gathered across chunks, the last one shorter). Clipped steps hold the gradient on
    the host (bf16, or fp32 sums over the window's micro-batches), whose touched rows go up with their state."""
    monkeypatch.setattr(touched_rows, "CAPACITY_SHARE", 1)  # up to all 97 rows
    monkeypatch.setattr(touched_rows, "MARGIN", 2.0)  # room for the most any later step touches: every one goes ahead
    step_mode, accumulate = MODES[mode]
    batches = token_batches(4 * accumulate)
    (cpu, cpu_model), (gpu, gpu_model) = (_engine(on, dtype, step_mode, monkeypatch, slots=slots)
                                          for on in (False, True))
    rows = gpu.adam.on_device.rows
    assert rows is not None and 0 in gpu.adam.on_device.units and (rows.held is None) == (mode == "eager")
    assert (gpu.storages[0].halves is not None) == (dtype == torch.bfloat16)
    _train(cpu, cpu_model, dtype, batches, accumulate)
    _train(gpu, gpu_model, dtype, batches, accumulate)
    assert rows.steps_ahead == len(batches) // accumulate - 1  # the staging is reserved after the first step
    assert_same_state(cpu, gpu)
    cpu.close(), gpu.close()


def test_the_pass_over_the_untouched_rows_gives_way_to_the_updates_queued_behind_it(monkeypatch):
    """Every other look finds items waiting: the pass stops after each chunk or two, goes behind them, and the
    embedding's boundary update queues what is left of it first."""
    import itertools

    from lightning_slide.threads import Worker

    looks = itertools.cycle([False, True])
    monkeypatch.setattr(Worker, "waiting", lambda self: next(looks))
    resumed, resume = [], device_update.DeviceUpdater.resume_untouched
    monkeypatch.setattr(device_update.DeviceUpdater, "resume_untouched",
                        lambda self, waiting=None: resumed.append(waiting is not None) or resume(self, waiting))
    batches = token_batches(3)
    (cpu, cpu_model), (gpu, gpu_model) = (_engine(on, torch.bfloat16, StepMode(), monkeypatch)
                                          for on in (False, True))
    _train(cpu, cpu_model, torch.bfloat16, batches)
    _train(gpu, gpu_model, torch.bfloat16, batches)
    assert gpu.adam.on_device.rows.steps_ahead == len(batches) - 1 and sum(resumed) > len(batches) - 1
    assert_same_state(cpu, gpu)
    cpu.close(), gpu.close()


def _short_first(count: int) -> list[torch.Tensor]:
    """A first step of 4 tokens (at most 4 rows), then `count` steps of 32 (about 27 of the 97 rows each)."""
    batches = token_batches(count + 1)
    return [batches[0][:, :2], *batches[1:]]


@pytest.mark.parametrize("mode", ["eager", "clipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-masters", "bf16-planes"])
def test_a_later_step_touching_more_rows_grows_the_staging_and_goes_ahead(dtype, mode, monkeypatch):
    """A short first step (a short first batch of examples) stages 5 rows; the next one touches more, the staging
    grows to hold them (a clipped step's held gradient rows too) and every later step goes ahead."""
    batches = _short_first(3)
    step_mode = MODES[mode][0]
    (cpu, cpu_model), (gpu, gpu_model) = (_engine(on, dtype, step_mode, monkeypatch) for on in (False, True))
    rows = gpu.adam.on_device.rows
    _train(gpu, gpu_model, dtype, batches[:1])
    first = rows.capacity
    _train(cpu, cpu_model, dtype, batches)
    _train(gpu, gpu_model, dtype, batches[1:])
    most = max(b.unique().numel() for b in batches[1:])
    assert first <= 5 < most <= rows.capacity and rows.steps_ahead == len(batches) - 1
    assert_same_state(cpu, gpu)
    cpu.close(), gpu.close()


@pytest.mark.parametrize("short", ["ram", "rows"])
def test_a_step_whose_rows_the_staging_cannot_hold_even_grown_updates_the_whole_table(short, monkeypatch):
    """Grown, the staging would take more than 1/4 of the host RAM free then (none is), or hold more than 1/4 of
    the table's rows (the first step's 5 rows staged fit under that)."""
    monkeypatch.setattr(touched_rows, "CAPACITY_SHARE", 2 if short == "ram" else 4)
    batches = _short_first(2)
    (cpu, cpu_model), (gpu, gpu_model) = (_engine(on, torch.float32, StepMode(), monkeypatch)
                                          for on in (False, True))
    rows = gpu.adam.on_device.rows
    _train(gpu, gpu_model, torch.float32, batches[:1])
    first = rows.capacity
    if short == "ram":
        monkeypatch.setattr(engine_module, "available_ram", engine_module.host_headroom)
    _train(cpu, cpu_model, torch.float32, batches)
    _train(gpu, gpu_model, torch.float32, batches[1:])
    assert 0 < first == rows.capacity and rows.steps_ahead == 0
    assert_same_state(cpu, gpu)
    cpu.close(), gpu.close()


@pytest.mark.parametrize(("free", "share", "why"), [(1024, 2, "of the free host RAM"), (1 << 40, 8, "more than 1/8")],
                         ids=["ram-short", "too-many-rows"])
def test_where_staging_would_not_pay_or_host_ram_is_short_the_embedding_updates_whole(free, share, why, monkeypatch):
    """The staging may take 1/4 of the host RAM free after the first step (here 1 KiB is free), and hold 1/2 of the
    table's rows (here 1/8: fewer than the first step touched)."""
    monkeypatch.setattr(engine_module, "available_ram", lambda: free + engine_module.host_headroom())
    monkeypatch.setattr(touched_rows, "CAPACITY_SHARE", share)
    batches = token_batches(2)
    (cpu, cpu_model), (gpu, gpu_model) = (_engine(on, torch.float32, StepMode(), monkeypatch)
                                          for on in (False, True))
    _train(cpu, cpu_model, torch.float32, batches)
    _train(gpu, gpu_model, torch.float32, batches)
    assert gpu.adam.on_device.rows is None
    assert any("updates whole" in note and why in note for note in gpu.notes), gpu.notes
    assert_same_state(cpu, gpu)
    cpu.close(), gpu.close()


def test_the_staging_holds_a_margin_over_the_rows_the_first_step_touched(monkeypatch):
    """Sized by the rows the data touched, not by its tokens: 2 x 16 tokens over 97 ids touch fewer than 32."""
    engine, model = _engine(True, torch.float32, StepMode(), monkeypatch)
    rows = engine.adam.on_device.rows
    first = token_batches(1)[0]
    _train(engine, model, torch.float32, [first])
    touched = first.unique().numel()
    assert touched < first.numel() and rows.capacity == math.ceil(touched * touched_rows.MARGIN)
    assert any(f"staging for {rows.capacity} touched rows" in note for note in engine.notes)
    engine.close()


@pytest.mark.parametrize(("free_rows", "touched", "capacity"), [(1000, 45, 50), (48, 45, 48), (1000, 51, None),
                                                                 (48, 49, None)],
                         ids=["half-trims", "ram-trims", "beyond-half", "beyond-ram"])
def test_the_limits_trim_the_staging_margin_but_refuse_only_touched_rows_beyond_them(free_rows, touched, capacity):
    """100 rows of 16 fp32 elements (192 staged bytes each): the staging holds at most 50 rows and 1/4 of the free
    host RAM (here the bytes of `free_rows` rows), and 5/4 of the rows touched where those allow."""
    rows = TouchedRows(0, 100, 16, torch.device("cpu"), None, lambda: 4 * free_rows * 192)
    refused = rows.reserve(touched)
    assert (refused is None) == (capacity is not None) and rows.capacity == (capacity or 0)


@pytest.mark.parametrize(("arch", "mode"), [("qwen2-tied", StepMode()), ("llama", StepMode(accumulates=True)),
                                            ("llama", StepMode(accumulates=True, manual=True))],
                         ids=["tied", "accumulated", "manual"])
def test_rows_are_updated_ahead_only_for_an_untied_embedding_updated_whole_in_a_step_known_before_its_backward(
        arch, mode, monkeypatch):
    """A tied embedding is read by the head after the forward that marked it; eager accumulation updates the sums
    chunk by chunk as they land; manual optimization's step is known only after its backwards."""
    engine, _ = _engine(True, torch.float32, mode, monkeypatch, arch=arch)
    assert 0 in engine.adam.on_device.units and engine.adam.on_device.rows is None
    engine.close()


def test_the_touched_rows_of_a_master_as_planes_are_gathered_across_its_chunks_and_scattered_back():
    """Rows of 16 elements in chunks of 64 (4 rows, the last chunk 2 rows): each chunk holds its weights first,
    then its low halves."""
    vocab, hidden = 18, 16
    master = torch.randn(vocab * hidden)
    halves = MasterHalves(master, 64)
    low = torch.randint(-(2**15), 2**15, (vocab * hidden,), dtype=torch.int16)
    for at, _, plane in halves.pieces(0, vocab * hidden):
        plane.copy_(low[at : at + plane.numel()])
    halves.parity.copy_(torch.randint(0, 256, halves.parity.shape, dtype=torch.uint8))
    moments = (torch.randn(vocab * hidden), torch.rand(vocab * hidden))
    rows = TouchedRows(0, vocab, hidden, torch.device("cpu"), 32, lambda: 1 << 30)
    assert rows.reserve(6) is None and rows.capacity == 8
    touched = torch.tensor([0, 3, 5, 15, 16, 17])
    views = rows_of(master, halves, moments, hidden)
    staged = rows.gather(touched, views)
    assert torch.equal(staged[0], low.view(vocab, hidden)[touched])
    assert torch.equal(staged[1], halves.parity.view(vocab, hidden // 8)[touched])
    assert torch.equal(staged[2], moments[0].view(vocab, hidden)[touched])
    before = master.clone(), halves.parity.clone(), *(m.clone() for m in moments)
    for s in staged:
        s.view(torch.uint8).bitwise_not_()
    rows.scatter(touched, views, staged)
    for s in staged:
        s.view(torch.uint8).bitwise_not_()
    rows.scatter(touched, views, staged)
    for now, then in zip((master, halves.parity, *moments), before):
        assert torch.equal(now, then)
