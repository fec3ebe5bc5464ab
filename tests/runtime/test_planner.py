"""The planner predicts what the runtime allocates, and refuses a run that cannot fit before anything is allocated."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import LlamaConfig

import lightning_slide.planner as planner
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy
from lightning_slide.planner import GiB, ModelShape, Plan, PlanError, Resources, Setup
from lightning_slide.step_mode import StepMode
from tests.runtime.helpers import (
    SEQ,
    VOCAB,
    CausalLM,
    engine_steps,
    param_groups,
    tiny_model,
    token_batches,
    trainer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# About 31M parameters: big enough that weights and state dominate the interpreter's own noise.
SMALL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
# Llama-3.1-8B's shape (built on the meta device only).
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def _engine_bytes(engine: SlideEngine) -> int:
    """Every buffer the engine allocated at construction: host state, slots, landing ring."""
    state = [t for s in engine.storages
             for t in (s.master, s.max_exp_avg_sq, s.shadow, s.grad_acc, *_packed(s.exp_avg), *_packed(s.exp_avg_sq))]
    state += engine.adam.buffers() + [codec.noise for codec in engine.moments.codecs[:1] if hasattr(codec, "noise")]
    window = engine.window
    slots = [s.params for s in [*window.ring, *window.dedicated.values()]] + [
        b.grads for b in [*window.block_grads, *window.dedicated_grads.values()]]
    landing = engine.pump.ring.buffers if engine.pump else []
    return sum(t.numel() * t.element_size() for t in [*state, *slots, *landing] if t is not None)


def _packed(moment) -> list[torch.Tensor]:
    """A moment's allocations: its values (an 8-bit moment's codes padded to 4 bytes) and its scales."""
    if moment.scales is None:
        return [moment.values]
    return [torch.empty(-(-moment.values.numel() // 4) * 4, dtype=torch.uint8), moment.scales]


@pytest.mark.parametrize(
    "arch, dtype, training, settings",
    [
        ("llama", torch.float32, True, {}),
        ("qwen2-tied", torch.float32, True, {"mode": StepMode(accumulates=True), "amsgrad": True}),
        ("llama", torch.bfloat16, True, {"mode": StepMode(clip_norm=1.0)}),
        ("qwen3", torch.bfloat16, True, {"config": SlideConfig(chunk_elems=1024)}),
        ("llama", torch.float32, True, {"config": SlideConfig(block_grad_buffers=5)}),
        ("llama", torch.float32, True, {"config": SlideConfig(slots=8)}),  # more slots than the model's 3 blocks
        ("llama", torch.bfloat16, True, {"config": SlideConfig(moment_precision="int8")}),
        ("qwen2-tied", torch.float32, True, {"config": SlideConfig(moment_precision="bf16", chunk_elems=1024)}),
        ("mistral", torch.float32, False, {}),
    ],
)
def test_static_plan_is_exactly_what_the_engine_allocates(arch, dtype, training, settings):
    model = tiny_model(arch)
    setup = Setup(**{"config": SlideConfig(), **settings}, device="cpu", dtype=dtype, training=training)
    optimizer = torch.optim.AdamW(param_groups(model), amsgrad=setup.amsgrad) if training else None
    _, plan = planner.plan_for_run(model, optimizer, setup)
    engine = SlideEngine(model, optimizer, setup.config, torch.device("cpu"), dtype, setup.mode)
    assert plan.total("ram") == _engine_bytes(engine)
    engine.close()


def test_frozen_parameters_get_no_optimizer_state_in_the_plan():
    model = tiny_model("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    shape, plan = planner.plan_for_run(model, optimizer, Setup(SlideConfig(), device="cpu", dtype=torch.float32))
    adam = next(e for e in plan.entries if e.what.startswith("Adam"))
    assert adam.bytes == 8 * (shape.numel - model.model.embed_tokens.weight.numel())


def _measure_in_this_process(case: dict) -> dict:
    """Peak RSS growth of building and training the SMALL model for 2 steps, against the planner's estimate."""
    import psutil
    from transformers import LlamaForCausalLM

    config, dtype = SlideConfig(**case["slide"]), torch.float32
    shape = ModelShape.from_config(LlamaConfig(**SMALL))
    mode = StepMode(accumulates=case["accumulate"])
    setup = Setup(config, "cpu", dtype, mode=mode, amsgrad=case["amsgrad"])
    estimate = Plan.estimate(shape, setup, case["micro_batch"], case["seq_len"]).total("ram")
    x = torch.randint(0, SMALL["vocab_size"], (case["micro_batch"], case["seq_len"]))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = psutil.Process().memory_info().rss
    model = LlamaForCausalLM(LlamaConfig(**SMALL))  # its weights become the master: inside the window
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters(), amsgrad=case["amsgrad"]), config,
                         torch.device("cpu"), dtype, mode)
    engine_steps(engine, model, [x, x])
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    return {"estimate": estimate, "measured": peak - base}


def measure_child() -> None:
    print(json.dumps(_measure_in_this_process(json.loads(sys.argv[1]))))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
@pytest.mark.parametrize(
    "case",
    [
        dict(slide={}, accumulate=False, amsgrad=False, micro_batch=2, seq_len=256),
        dict(slide={"activations": "cpu"}, accumulate=True, amsgrad=True, micro_batch=4, seq_len=128),
    ],
    ids=["plain", "sums-amsgrad-offloaded-activations"],
)
def test_estimate_is_within_ten_percent_of_measured_peak_rss(case):
    """Measured in a fresh interpreter, so nothing earlier in the session sets the peak or fills the heap.

    glibc's mmap threshold is fixed so that freed tensors leave RSS, as every tensor of a real LLM (over
    32 MiB) does anyway; otherwise the small model's freed init weights would linger in the heap.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    code = "from tests.runtime.test_planner import measure_child; measure_child()"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(case)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    error = result["estimate"] / result["measured"] - 1
    assert abs(error) <= 0.10, (f"estimate {result['estimate'] / 2**20:.0f} MiB, "
                                f"measured {result['measured'] / 2**20:.0f} MiB")


def _llama_8b() -> ModelShape:
    return ModelShape.from_config(LlamaConfig(**LLAMA_8B))


def test_an_8b_model_on_too_little_ram_is_refused_with_needed_available_and_what_to_change():
    shape = _llama_8b()
    plan = Plan.estimate(shape, Setup(SlideConfig(), mode=StepMode(accumulates=True)), micro_batch=8, seq_len=1024)
    with pytest.raises(PlanError) as caught:
        plan.check(Resources(ram=64 * GiB, gpu=24 * GiB))
    message = str(caught.value)
    needed = plan.total("pinned", "ram") / GiB
    assert needed > 64
    assert f"host RAM: it needs {needed:.2f} GiB, 64.00 GiB available" in message
    assert "offload='nvme'" in message
    assert "accumulate_grad_batches=1 and automatic optimization" in message


def test_too_many_tokens_on_the_gpu_are_refused_naming_activation_offload_and_micro_batch():
    shape = _llama_8b()
    plan = Plan.estimate(shape, Setup(SlideConfig(activations="device")), micro_batch=64, seq_len=1024)
    with pytest.raises(PlanError) as caught:
        plan.check(Resources(ram=512 * GiB, gpu=24 * GiB))
    message = str(caught.value)
    assert f"GPU memory: it needs {plan.total('gpu') / GiB:.2f} GiB, 24.00 GiB available" in message
    assert "activations='cpu'" in message and "smaller micro-batch" in message


def test_a_plan_that_fits_passes_the_check():
    plan = Plan.estimate(_llama_8b(), Setup(SlideConfig()), micro_batch=8, seq_len=1024)
    plan.check(Resources(ram=126 * GiB, gpu=24 * GiB))
    assert plan.total("gpu") < 24 * GiB


def test_auto_activations_move_to_pinned_ram_when_they_would_crowd_the_gpu():
    shape, setup = _llama_8b(), Setup(SlideConfig(activations="auto"))
    roomy = Plan.estimate(shape, setup, 8, 1024, Resources(ram=126 * GiB, gpu=120 * GiB))
    tight = Plan.estimate(shape, setup, 8, 1024, Resources(ram=126 * GiB, gpu=10 * GiB))
    acts = 34 * 8 * 1024 * 4096 * 2  # 32 blocks + norm + lm_head inputs, bf16
    assert any(e.where == "gpu" and e.bytes == acts for e in roomy.entries)
    assert any(e.where == "pinned" and e.bytes == acts for e in tight.entries)


def test_pinned_saved_inputs_take_their_size_and_pinned_disk_staging_a_power_of_two(tmp_path):
    """A hidden width of 5,120 (Qwen3-14B's) at 64 x 1024 tokens: each bf16 input is 640 MiB. Saved inputs are
    page-locked in place; staging buffers come from torch's caching host allocator, which rounds up."""
    shape = ModelShape.from_config(LlamaConfig(**{**LLAMA_8B, "hidden_size": 5120, "num_hidden_layers": 4}))
    in_ram = Plan.estimate(shape, Setup(SlideConfig(activations="cpu")), 64, 1024)
    on_disk = Plan.estimate(shape, Setup(SlideConfig(offload="nvme", nvme_path=str(tmp_path), activations="nvme",
                                                     gds="off")), 64, 1024)
    saved = next(e for e in in_ram.entries if e.what.startswith("saved part inputs"))
    staging = next(e for e in on_disk.entries if e.what.startswith("disk staging"))
    assert (saved.where, saved.bytes) == ("pinned", shape.saves * 640 * 2**20)
    assert (staging.where, staging.bytes) == ("pinned", planner.DISK_BUFFERS * GiB)


def test_a_refusal_in_a_memory_cgroup_names_its_limit():
    plan = Plan.estimate(_llama_8b(), Setup(SlideConfig()), micro_batch=8, seq_len=1024)
    with pytest.raises(PlanError, match=r"host RAM.*memory cgroup allows it 64\.00 GiB"):
        plan.check(Resources(ram=60 * GiB, gpu=120 * GiB, ram_limit=64 * GiB))


def test_8b_with_8_bit_moments_fits_a_64_gib_desktop_unclipped_and_clipping_is_refused_by_name():
    desktop = Resources(ram=62 * GiB, gpu=22 * GiB, headroom=int(3.2 * GiB), ram_limit=64 * GiB)
    for clip, fits in ((None, True), (1.0, False)):
        setup = Setup(SlideConfig(moment_precision="int8"), mode=StepMode(clip_norm=clip))
        plan = Plan.estimate(_llama_8b(), setup, micro_batch=8, seq_len=1024)
        if fits:
            plan.check(desktop)
        else:
            with pytest.raises(PlanError, match=r"held gradients.*gradient_clip_val=None"):
                plan.check(desktop)


def test_a_micro_batch_that_needs_no_host_memory_fits_where_the_setup_left_less_than_the_headroom_free():
    """(Mistral-Small-24B's shapes with 8-bit moments on a 126 GiB machine: the static plan took the host RAM down
    to its headroom, so the host had less free than the headroom at the first micro-batch, which needs none.)"""
    shape, setup = _llama_8b(), Setup(SlideConfig(activations="device"))
    needs = Plan.static(shape, setup).batch(shape, setup, 8, 1024, 24 * GiB)
    assert needs.total("pinned", "ram") == 0 < needs.total("gpu")
    needs.check(Resources(ram=int(5.1 * GiB), gpu=20 * GiB, headroom=int(6.3 * GiB)))
    with pytest.raises(PlanError, match="GPU memory"):
        needs.check(Resources(ram=int(5.1 * GiB), gpu=needs.total("gpu") - 1, headroom=int(6.3 * GiB)))


def test_memory_already_held_by_the_model_counts_as_available():
    plan = Plan.static(ModelShape.from_model(tiny_model(), set()), Setup(SlideConfig(), device="cpu"))
    need = plan.total("ram")
    plan.check(Resources(ram=need // 2, resident=need - need // 2))
    with pytest.raises(PlanError, match="already hold, which become the fp32 master"):
        plan.check(Resources(ram=need // 2, resident=need // 4))


def test_describe_lists_every_entry_and_each_location_total():
    plan = Plan.estimate(_llama_8b(), Setup(SlideConfig(activations="cpu"), mode=StepMode(clip_norm=1.0)), 8, 1024)
    text = plan.describe()
    for e in plan.entries:
        assert f"{e.what}" in text and f"{e.bytes / GiB:.3f} GiB" in text
    for where in ("gpu", "pinned", "ram"):
        assert f"{plan.total(where) / GiB:.3f} GiB" in text
    assert len(text.splitlines()) == 1 + len(plan.entries) + 3


def _own_storage(module: torch.nn.Module) -> bool:
    """True while no parameter has been moved into a flat master buffer (each still owns its storage)."""
    return all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in module.parameters())


def test_fit_refuses_at_setup_before_the_engine_allocates(monkeypatch):
    monkeypatch.setattr(planner, "available_ram", lambda: 0)
    module = CausalLM(tiny_model())
    strategy = SlideStrategy()
    with pytest.raises(PlanError, match="host RAM: it needs .* GiB available .* To fit, change: "):
        trainer(strategy, 2).fit(module, DataLoader(token_batches(2), batch_size=None))
    assert strategy.engine is None
    assert _own_storage(module)


def test_fit_keeps_the_plan_of_what_it_allocated():
    model = tiny_model("qwen2-tied")
    module = CausalLM(copy.deepcopy(model))
    strategy = SlideStrategy()
    trainer(strategy, 1, accumulate=2).fit(module, DataLoader(token_batches(2), batch_size=None))
    n = sum(p.numel() for p in model.parameters())
    sizes = {e.what: e.bytes for e in strategy.plan.entries}
    assert sizes["fp32 master weights"] == 4 * n
    assert sizes["fp32 gradient sums"] == 4 * n


def test_a_micro_batch_that_cannot_fit_is_refused_before_its_forward(monkeypatch):
    class RamRunsOut(Callback):
        def on_train_start(self, trainer, pl_module):  # after setup's static check, before the first batch
            monkeypatch.setattr(planner, "available_ram", lambda: 1024)

    with pytest.raises(PlanError, match="micro-batch"):
        trainer("slideformer", 1, callbacks=[RamRunsOut()]).fit(
            CausalLM(tiny_model()), DataLoader(token_batches(1), batch_size=None))


def test_a_later_larger_micro_batch_is_checked_before_its_forward_and_same_size_ones_are_not(monkeypatch):
    seen = []

    class RamRunsOutAfterTheFirstBatch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(tuple(batch.shape))
            monkeypatch.setattr(planner, "available_ram", lambda: 1024)

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for rows in (2, 2, 4)]
    with pytest.raises(PlanError, match="micro-batch"):
        trainer("slideformer", 3, callbacks=[RamRunsOutAfterTheFirstBatch()]).fit(
            CausalLM(tiny_model()), DataLoader(batches, batch_size=None))
    assert seen == [(2, SEQ), (2, SEQ)]


def test_the_token_shape_of_a_hugging_face_batch_encoding_is_found():
    from transformers import BatchEncoding

    from lightning_slide.strategy import _token_shape

    ids = torch.randint(0, VOCAB, (3, SEQ))
    batch = BatchEncoding({"attention_mask": torch.ones(3, SEQ, dtype=torch.long), "input_ids": ids})
    assert _token_shape(batch) == (3, SEQ)
    assert _token_shape({"pixel_values": torch.randn(3, SEQ)}) is None


def test_the_batch_plan_with_kernels_is_calibrated_below_the_hf_modules_workspace():
    shape = _llama_8b()
    with_kernels = Plan.static(shape, Setup(SlideConfig())).batch(shape, Setup(SlideConfig()), 64, 1024)
    without = Plan.static(shape, Setup(SlideConfig(use_kernels=False))).batch(
        shape, Setup(SlideConfig(use_kernels=False)), 64, 1024)
    workspace = {p: next(e.bytes for e in p.entries if e.what.startswith("compute workspace"))
                 for p in (with_kernels, without)}
    assert workspace[with_kernels] < 0.8 * workspace[without]


def test_the_loss_heads_workspace_grows_with_the_fused_loss_buffer():
    """At one short sequence the loss head, not a block, is the costliest recompute: its logits buffer counts."""
    def workspace(mib: float) -> int:
        plan = Plan.estimate(_llama_8b(), Setup(SlideConfig(loss_chunk_mib=mib)), micro_batch=1, seq_len=128)
        return next(e.bytes for e in plan.entries if e.what.startswith("compute workspace"))

    assert workspace(256) - workspace(63) == 193 * 2**20


def test_recompute_never_plans_every_blocks_graph_and_names_recompute_when_it_cannot_fit():
    shape = _llama_8b()
    setup = Setup(SlideConfig(recompute="never"))
    plan = Plan.estimate(shape, setup, micro_batch=8, seq_len=1024)
    kept = next(e for e in plan.entries if e.what.startswith("kept graphs of 32 blocks"))
    assert kept.bytes == 32 * 8 * 1024 * planner._block_graph_per_token(shape, setup, 8 * 1024)
    default = Plan.estimate(shape, Setup(SlideConfig()), 8, 1024)
    assert not any(e.what.startswith("kept graphs") for e in default.entries)
    with pytest.raises(PlanError, match="recompute='auto'"):
        plan.check(Resources(ram=126 * GiB, gpu=24 * GiB))


def test_a_plan_must_leave_the_hosts_headroom_free():
    plan = Plan.static(ModelShape.from_model(tiny_model(), set()), Setup(SlideConfig(), device="cpu"))
    need = plan.total("ram")
    plan.check(Resources(ram=need + GiB, headroom=GiB))
    with pytest.raises(PlanError, match="after the 1.00 GiB kept free for the rest of the system"):
        plan.check(Resources(ram=need + GiB - 1, headroom=GiB))


def test_the_probe_keeps_a_twentieth_of_the_ram_free_and_counts_what_the_process_holds():
    import psutil

    resources = Resources.probe(torch.device("cpu"))
    assert resources.headroom >= 0.05 * psutil.virtual_memory().total - 1
    assert resources.process > 0
    plan = Plan.static(ModelShape.from_model(tiny_model(), set()), Setup(SlideConfig(), device="cpu"))
    assert plan.peak_rss(resources) == plan.total("ram") + resources.process


@pytest.mark.parametrize("micro_batch, own", [(8, "all"), (64, "embed+head")])
def test_a_clipped_8b_step_holds_bf16_gradients_outside_saved_input_buffers_only_where_they_do_not_fit(
        micro_batch, own):
    shape, setup = _llama_8b(), Setup(SlideConfig(activations="cpu"), mode=StepMode(clip_norm=1.0))
    plan = Plan.estimate(shape, setup, micro_batch, 1024)
    held = next(e for e in plan.entries if e.what.startswith("held gradients"))
    units = shape.units if own == "all" else (shape.units[0], shape.units[-1])
    assert held.bytes == 2 * sum(u.trainable for u in units)
    assert not any("sums" in e.what for e in plan.entries)


def test_the_plan_counts_one_shard_of_the_hugging_face_export(tmp_path):
    from lightning_slide.callbacks import HFExport

    module = CausalLM(tiny_model("llama"))
    plans = []

    class Grab(Callback):
        def on_train_start(self, trainer, pl_module):
            plans.append(trainer.strategy.plan)

    export = HFExport(tmp_path / "hf", dtype="float32", max_shard_size="20KB")
    trainer(SlideStrategy(), 1, callbacks=[export, Grab()]).fit(module, DataLoader(token_batches(1), batch_size=None))
    entry = next(e for e in plans[0].entries if e.what.startswith("Hugging Face export"))
    assert entry.bytes == 20_000 == export.host_bytes(module)


def _workspace(plan: Plan) -> int:
    return next(e.bytes for e in plan.entries if e.what.startswith("compute workspace"))


def test_a_tiled_mlp_bounds_the_blocks_workspace_by_its_tile_not_the_sequence(monkeypatch):
    """On CUDA "auto" tiles Llama-3.1-8B's MLP past 1 GiB per intermediate tensor: doubling the sequence then adds
    the block's other per-token terms and at most a change of tile size (tiles of at most 256 MiB per buffer),
    and the MLP's intermediates (four per token) are gone. (Attention in one call, as at up to 32,768 tokens.)"""
    import lightning_slide.ops.grouped_attention as grouped
    from lightning_slide.graphs import block_graph_per_token
    from lightning_slide.ops.tiled_mlp import TILE_MIB, TILE_TENSORS

    monkeypatch.setattr(grouped, "UNGROUPED_MIB", 1 << 40)

    shape, tiles_at_most = _llama_8b(), TILE_TENSORS * TILE_MIB * 2**20
    tiled, untiled = Setup(SlideConfig()), Setup(SlideConfig(mlp_tile_tokens=None))
    per_token = block_graph_per_token(4096, 4096, 1024, 14336, 2, True, mlp_tiled=True)
    long, longer = (_workspace(Plan.estimate(shape, tiled, 1, n)) for n in (131072, 262144))
    assert 0 <= longer - long - 131072 * per_token <= tiles_at_most
    saved = _workspace(Plan.estimate(shape, untiled, 1, 131072)) - long
    assert saved >= 0.75 * 131072 * 4 * 14336 * 2 - tiles_at_most
    short = (_workspace(Plan.estimate(shape, s, 1, 32768)) for s in (tiled, untiled))
    assert len(set(short)) == 1  # below the threshold "auto" leaves the MLP untiled


def test_long_attention_over_groups_of_heads_leaves_all_but_one_groups_flash_buffers_off_the_workspace():
    """Llama-3.1-8B at one 131,072-token sequence: the flash backward's fp32 query accumulator and expanded
    key/value gradients of 32 heads (4 GiB) are planned for one key/value head's 4 query heads instead."""
    import lightning_slide.ops.grouped_attention as grouped

    shape, config = _llama_8b(), SlideConfig(activations="cpu")
    one_call, over_groups = (_workspace(Plan.estimate(shape, Setup(config, grouped_attention=on), 1, 131072))
                             for on in (False, True))
    saving = grouped.workspace_saving(131072, 32, 8, 128, 2)
    assert saving == 4 * GiB - grouped.group_bytes(131072, 32, 8, 128, 2, 1) > 3 * GiB
    assert one_call - over_groups == saving


def test_attention_runs_over_groups_of_heads_only_where_the_micro_batch_does_not_fit_in_one_call():
    """8B at 131,072 tokens, MLP tiles "auto": with room for the tiled plan it stays in one call (SDPA's faster
    kernels); with less, but room for the grouped plan, it is grouped; a shorter sequence never is."""
    from lightning_slide.ops.tiled_mlp import even_tiles

    shape, setup, tile = _llama_8b(), Setup(SlideConfig(activations="cpu")), even_tiles(131072, 14336, 2)
    static = Plan.static(shape, setup)
    one_call, over_groups = (
        static.batch(shape, Setup(SlideConfig(activations="cpu", mlp_tile_tokens=tile), grouped_attention=on), 1,
                     131072, None).total("gpu") for on in (False, True))
    for gpu, grouped in ((one_call, False), ((one_call + over_groups) // 2, True)):
        resources = Resources(ram=400 * GiB, gpu=gpu)
        decided, needs = planner.resolve_batch_setup(static, shape, setup, 1, 131072, resources, None)
        assert decided.grouped_attention is grouped and decided.config.mlp_tile_tokens == tile
        needs.check(resources)
    short, _ = planner.resolve_batch_setup(static, shape, setup, 1, 16384, Resources(ram=400 * GiB, gpu=GiB), None)
    assert not short.grouped_attention  # nothing to save there: refused as before, in one call


@pytest.mark.parametrize("micro_batch, seq_len, prefetched", [(8, 1024, True), (1, 131072, False)])
def test_a_saved_input_in_ram_of_a_gib_or_more_is_planned_to_come_back_after_the_peak_it_would_add_to(
        micro_batch, seq_len, prefetched):
    """Inputs in RAM come back during the backward before their own; from 1 GiB (8B at 131,072 tokens) after it."""
    plan = Plan.estimate(_llama_8b(), Setup(SlideConfig(activations="cpu")), micro_batch, seq_len)
    entry = next(e for e in plan.entries if e.what.startswith("hidden states in flight"))
    assert entry.bytes == (4 if prefetched else 3) * micro_batch * seq_len * 4096 * 2


@pytest.mark.parametrize("micro_batch, seq_len, tiled", [(64, 1024, False), (1, 131072, True)])
def test_auto_tiling_leaves_a_micro_batch_untiled_where_its_plan_fits_so_and_tiles_it_where_not(
        micro_batch, seq_len, tiled):
    """8B under 24 GiB: 64 x 1024 tokens fit untiled (no extra gate and up GEMMs), one 131,072-token sequence
    does not, so it gets the tiles `tile_for` picks; a setting other than "auto" stands."""
    from lightning_slide.ops.tiled_mlp import tile_for

    shape, setup = _llama_8b(), Setup(SlideConfig(activations="cpu"))
    static, resources = Plan.static(shape, setup), Resources(ram=400 * GiB, gpu=24 * GiB - 6 * GiB)
    gpu_free = resources.gpu + static.total("gpu")
    decided, needs = planner.resolve_mlp_tiles(static, shape, setup, micro_batch, seq_len, resources, gpu_free)
    tokens = micro_batch * seq_len
    assert decided.config.mlp_tile_tokens == (tile_for("auto", tokens, 14336, 2) if tiled else None)
    assert tile_for("auto", tokens, 14336, 2) is not None  # the 1 GiB rule alone would tile both
    assert needs.entries == static.batch(shape, decided, micro_batch, seq_len, gpu_free).entries
    needs.check(resources)
    fixed = Setup(SlideConfig(activations="cpu", mlp_tile_tokens=4096))
    assert planner.resolve_mlp_tiles(static, shape, fixed, micro_batch, seq_len, resources, gpu_free)[0] is fixed


def test_auto_tiling_tiles_a_micro_batch_below_the_one_gib_rule_where_only_tiles_fit():
    """8B at 32,768 tokens (one tokens x intermediate tensor: 0.88 GiB) with less VRAM than it needs untiled."""
    from lightning_slide.ops.tiled_mlp import even_tiles, tile_for

    shape, setup = _llama_8b(), Setup(SlideConfig(activations="cpu"))
    static = Plan.static(shape, setup)
    untiled, tiled = (static.batch(shape, Setup(SlideConfig(activations="cpu", mlp_tile_tokens=t)), 1, 32768, None)
                      for t in (None, even_tiles(32768, 14336, 2)))
    gpu = static.total("gpu") + (untiled.total("gpu") + tiled.total("gpu")) // 2  # between the two
    resources = Resources(ram=400 * GiB, gpu=gpu - static.total("gpu"))
    decided, needs = planner.resolve_mlp_tiles(static, shape, setup, 1, 32768, resources, gpu)
    assert tile_for("auto", 32768, 14336, 2) is None  # the 1 GiB rule alone would leave it untiled
    assert decided.config.mlp_tile_tokens == even_tiles(32768, 14336, 2) is not None
    needs.check(resources)


def test_on_the_cpu_auto_leaves_mlps_untiled_and_a_number_tiles_them():
    """(A small vocabulary, so that a block and not the unfused loss head is the costliest recompute.)"""
    shape, long = ModelShape.from_config(LlamaConfig(**{**LLAMA_8B, "vocab_size": 1000})), 65536
    plans = {setting: Plan.estimate(shape, Setup(SlideConfig(mlp_tile_tokens=setting), device="cpu"), 1, long)
             for setting in ("auto", None, 4096)}
    assert _workspace(plans["auto"]) == _workspace(plans[None]) > _workspace(plans[4096])


def test_a_sequence_that_cannot_fit_is_refused_naming_the_longest_that_fits_and_what_to_change():
    shape, setup = _llama_8b(), Setup(SlideConfig(activations="cpu"))
    static, resources = Plan.static(shape, setup), Resources(ram=400 * GiB, gpu=24 * GiB - 6 * GiB)
    gpu_free = resources.gpu + static.total("gpu")
    needs = static.batch(shape, setup, 1, 1 << 20, gpu_free)
    with pytest.raises(PlanError) as caught:
        planner.check_batch(needs, static, shape, setup, 1, 1 << 20, resources, gpu_free)
    message = str(caught.value)
    longest = planner.longest_seq_len(static, shape, setup, 1, resources, gpu_free, 1 << 20)
    assert f"This micro-batch has 1 x 1,048,576 tokens; the longest sequence that fits at a micro-batch of 1 is " \
           f"{longest:,} tokens" in message
    assert "GPU memory" in message and "a smaller micro-batch or sequence length" in message
    static.batch(shape, setup, 1, longest, gpu_free).check(resources)
    with pytest.raises(PlanError):
        static.batch(shape, setup, 1, longest + 1, gpu_free).check(resources)


def test_without_tiles_the_refusal_names_mlp_tiling():
    shape, setup = _llama_8b(), Setup(SlideConfig(mlp_tile_tokens=None, activations="cpu"))
    plan = Plan.estimate(shape, setup, 1, 262144)
    with pytest.raises(PlanError, match=r"mlp_tile_tokens=8192 \(MLPs over sequence tiles\)"):
        plan.check(Resources(ram=400 * GiB, gpu=24 * GiB))
