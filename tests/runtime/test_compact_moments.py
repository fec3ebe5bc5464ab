"""moment_precision="bf16" | "int8": Adam's moments compact in RAM, on disk and in checkpoints; each update is torch's
AdamW on the decoded moments, training stays close to fp32, and resumes and conversions are exact."""

import copy
import math

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_slide.layer_adam as layer_adam
from lightning_slide import SlideConfig, SlideEngine, SlideStrategy
from lightning_slide.layer_adam import DeferredUpdate, LayerAdam, snapshot
from lightning_slide.moment_codec import BLOCK, Bf16Codec, Int8Codec, Packed, noise_position
from lightning_slide.moments import Moments
from lightning_slide.planner import ModelShape, Plan, Setup
from lightning_slide.storage import UnitStorage
from lightning_slide.threads import Failure
from tests.runtime.helpers import (
    VOCAB,
    CausalLM,
    engine_steps,
    fit,
    param_groups,
    tiny_model,
    token_batches,
    trainer,
)
from tests.runtime.test_planner import LLAMA_8B

COMPACT = ["bf16", "int8"]


# ------------------------------------------------------------------------------------------- plain references
def magnitudes(signed: bool) -> torch.Tensor:
    """The 8-bit float codes' magnitudes, by definition: exponent e (4 bits) and mantissa f (3 bits signed, 4
    unsigned) stand for (1 + f / 2^bits) 2^(e - 15), or f / 2^bits 2^-14 when e = 0."""
    bits = 3 if signed else 4
    values = [(f / 2**bits) * 2.0**-14 if e == 0 else (1 + f / 2**bits) * 2.0 ** (e - 15)
              for e in range(16) for f in range(2**bits)]
    return torch.tensor(values, dtype=torch.float32)


def reference_quantise(x: torch.Tensor, signed: bool, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit as the paper states it, with the float codes and stochastic rounding: per block, scale by
    the absmax; of the two codes around each magnitude (exp_avg_sq: its square root) take the upper one when the
    magnitude's fraction of the way between them is at least 1 - noise / 2^16 (16 random bits an element)."""
    grid = magnitudes(signed).double()
    x = x if signed else x.double().sqrt().float()  # the root rounded to nearest (IEEE; torch's fp32 CPU sqrt is not)
    codes, scales = [], []
    for block, bits in zip(x.split(BLOCK), noise.split(BLOCK)):
        scale = block.abs().max()
        scales.append(scale)
        y = block / scale.clamp(min=torch.finfo(torch.float32).tiny)
        magnitude = y.abs().double()
        below = (torch.searchsorted(grid, magnitude, right=True) - 1).clamp(max=grid.numel() - 1)
        above = (below + 1).clamp(max=grid.numel() - 1)
        gap = (grid[above] - grid[below]).clamp(min=1e-300)
        up = (magnitude - grid[below]) / gap * 2**16 >= 2**16 - bits.double()
        code = torch.where(up & (above > below), above, below)
        codes.append((code + 128 * torch.signbit(y).long() * signed).to(torch.uint8))
    return torch.cat(codes), torch.stack(scales)


def reference_dequantise(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    grid, codes = magnitudes(signed), codes.long()
    y = torch.where(codes >= 128, -grid[codes % 128], grid[codes % 128]) if signed else grid[codes]
    x = y * scales.repeat_interleave(BLOCK)[: codes.numel()]
    return x if signed else x.square()


def reference_stochastic_round(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Add 16 random bits below bf16's last kept bit, then truncate to bf16."""
    bits = (x.view(torch.int32).long() + noise.long()) & 0xFFFF0000
    return (bits - (bits >= 2**31).long() * 2**32).int().view(torch.float32).bfloat16()


def _noise_at(step: int, unit: int, moment: int, start: int, n: int) -> torch.Tensor:
    """Each element's 16 rounding bits, by the definition: its own table entry, wherever its piece starts."""
    table = Bf16Codec(moment).noise
    return torch.cat([table[noise_position(step, unit, moment, i) :][:1] for i in range(start, start + n)])


# ------------------------------------------------------------------------------------------------- the codecs
def test_each_int8_code_stands_for_its_float_value():
    for moment, signed in ((0, True), (1, False)):
        expected = torch.cat([magnitudes(True), -magnitudes(True)]) if signed else magnitudes(False)
        assert torch.equal(Int8Codec(moment).qmap, expected)


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_int8_round_trip_lands_on_a_code_next_to_each_value(signed):
    """Magnitudes spread over six decades within each block; the decoded value (exp_avg_sq: its square root) is one
    of the two codes around it: within a step of the code's mantissa (1/8 of the value for exp_avg, 1/16 for the
    root) above 2^-14 of the block's absmax, and within the subnormal step below; as the reference rounds it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5 * BLOCK + 77, generator=g) * 10 ** torch.empty(5 * BLOCK + 77).uniform_(-6, 0, generator=g)
    moment = 0 if signed else 1
    codec = Int8Codec(moment)
    packed = codec.zeros(x.numel())
    codec.encode((x if signed else x.square()).clone(), packed, 1, 0, 0)
    codes, scales = reference_quantise(x if signed else x.square(), signed, _noise_at(1, 0, moment, 0, x.numel()))
    assert torch.equal(packed.values, codes) and torch.equal(packed.scales, scales)
    decoded = codec.decode(packed, torch.empty(x.numel()))
    x, decoded = (x, decoded) if signed else (x.abs(), decoded.sqrt())
    scales = packed.scales.repeat_interleave(BLOCK)[: x.numel()]
    step = 2.0 ** -(3 if signed else 4)
    assert torch.all((decoded - x).abs() <= torch.maximum(step * x.abs(), step * 2.0**-14 * scales) * (1 + 1e-5))


def test_int8_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    """1,000 blocks, each of its absmax (1.0) and elements a quarter of the way from the code 0.5 to the next
    (0.5625): each lands on one of the two, the upper a quarter of the time."""
    x = torch.full((1000, BLOCK), 0.5 + 2**-6)
    x[:, 0] = 1.0
    codec = Int8Codec(0)
    packed = codec.zeros(x.numel())
    codec.encode(x.flatten().clone(), packed, 3, 1, 0)
    values = codec.decode(packed, torch.empty(x.numel())).view(x.shape)[:, 1:]
    assert set(values.unique().tolist()) == {0.5, 0.5625}
    assert abs(float(values.mean()) - (0.5 + 2**-6)) < 4 * 2**-4 * math.sqrt(0.25 * 0.75 / values.numel())


def test_8_bit_exp_avg_sq_decays_as_fp32s_does_beside_a_larger_element_of_its_block():
    """An element whose gradient stopped, in a block whose largest element keeps its own: exp_avg_sq decays by
    beta2 = 0.999 a step, 0.1%, far below a code's step of 6-12%. Rounded to nearest it would never move; rounded
    stochastically it follows fp32's decay (here over 2,000 steps, to 13.5% of where it began)."""
    codec, n = Int8Codec(1), BLOCK
    packed = codec.zeros(n)
    v = torch.zeros(n)
    v[0], v[1:] = 1.0, 1e-2  # the block's largest, and the others after their last large gradient
    codec.encode(v.clone(), packed, 0, 0, 0)
    exact = v.clone()
    for step in range(1, 2001):
        g2 = torch.zeros(n)
        g2[0] = 1.0
        decoded = codec.decode(packed, torch.empty(n)).clone()
        codec.encode(decoded.mul_(0.999).add_(g2, alpha=0.001), packed, step, 0, 0)
        exact.mul_(0.999).add_(g2, alpha=0.001)
    ratio = codec.decode(packed, torch.empty(n))[1:] / exact[1:]
    assert exact[1] < 0.14e-2 and 0.9 < float(ratio.mean()) < 1.1


def test_bf16_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16 (1 + 2**-7)
    codec, packed = Bf16Codec(0), Bf16Codec(0).zeros(x.numel())
    codec.encode(x.clone(), packed, 3, 1, 0)
    values = packed.values.float()
    assert set(values.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(float(values.mean()) - (1.0 + 2**-9)) < 4 * 2**-7 * math.sqrt(0.25 * 0.75 / x.numel())


def test_bf16_rounding_depends_on_step_unit_and_index_only():
    x = torch.randn(3000)
    whole, pieces = Bf16Codec(1).zeros(3000), Bf16Codec(1).zeros(3000)
    Bf16Codec(1).encode(x.clone(), whole, 5, 2, 0)
    for a in range(0, 3000, 1024):
        Bf16Codec(1).encode(x[a : a + 1024].clone(), pieces[a : a + 1024], 5, 2, a)
    assert torch.equal(whole.values, pieces.values)
    other = Bf16Codec(1).zeros(3000)
    Bf16Codec(1).encode(x.clone(), other, 6, 2, 0)
    assert not torch.equal(whole.values, other.values)


# ---------------------------------------------------------------------------------- one update, exactly
def _unit(precision: str) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW, UnitStorage, LayerAdam]:
    """One unit of three parameters in two param groups (2,900 trained elements: blocks span parameters and the
    last one is partial), its compact moments filled with a step's worth of state."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((30, 40), (700,), (1000,))]
    optimizer = torch.optim.AdamW([{"params": [params[0], params[2]]}, {"params": [params[1]], "weight_decay": 0}],
                                  lr=1e-2, betas=(0.8, 0.95))
    group_of = {id(params[0]): 0, id(params[2]): 0, id(params[1]): 1}
    storage = UnitStorage(0, "unit", params, group_of)
    moments = Moments([storage], {}, storage.trainable_numel, Failure(None), precision)
    for codec, moment, scale in zip(moments.codecs, (storage.exp_avg, storage.exp_avg_sq), (1e-2, 1e-4)):
        codec.encode(torch.randn(storage.trainable_numel, generator=g).mul_(scale).abs_().mul_(
            torch.randn(storage.trainable_numel, generator=g).sign() if codec.moment == 0 else 1), moment, 9, 0, 0)
    return params, optimizer, storage, LayerAdam([storage], moments, Failure(None))


def _reference_step(storage: UnitStorage, optimizer: torch.optim.AdamW, grad: torch.Tensor, precision: str,
                    step: int, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Decode the moments, torch.optim.AdamW(fused=True) over copies of the parameters on `device`, encode them
    again (on the CPU)."""
    decoded = [_decode(m, precision, signed=i == 0) for i, m in enumerate((storage.exp_avg, storage.exp_avg_sq))]
    copies = [torch.nn.Parameter(p.detach().clone().to(device)) for p in storage.params]
    copy_of = {id(p): q for p, q in zip(storage.params, copies)}
    groups = [{**{k: v for k, v in g.items() if k != "fused"}, "params": [copy_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    ref = torch.optim.AdamW(groups, fused=True)
    for p, q in zip(storage.params, copies):
        at, n = storage.offsets[id(p)], p.numel()
        state = {"step": torch.tensor(float(step - 1)), "exp_avg": decoded[0][at : at + n],
                 "exp_avg_sq": decoded[1][at : at + n]}
        q.grad = grad[at : at + n].view(p.shape).to(device, copy=True)
        ref.state[q] = {k: v.view(p.shape if v.dim() else ()).to(device, copy=True) for k, v in state.items()}
    ref.step()
    master = torch.cat([q.detach().reshape(-1) for q in copies]).cpu()
    flat = [torch.cat([ref.state[q][key].reshape(-1) for q in copies]).cpu() for key in ("exp_avg", "exp_avg_sq")]
    return master, [_encode(x, precision, i, step) for i, x in enumerate(flat)]


def run_and_compare(adam: LayerAdam, item: object, storage: UnitStorage, master: torch.Tensor,
                    moments: list[list[torch.Tensor]]) -> None:
    """Run one update item on the optimizer thread, stop it, and check the unit's master and stored moments."""
    adam.schedule(0)
    adam.put(item)
    adam.drain()
    adam.stop()
    adam.close()
    storage.release()
    assert torch.equal(storage.master, master)
    for got, expected in zip((storage.exp_avg, storage.exp_avg_sq), moments):
        assert torch.equal(got.values, expected[0])
        if got.scales is not None:
            assert torch.equal(got.scales, expected[1])


def _decode(moment: Packed, precision: str, signed: bool) -> torch.Tensor:
    if precision == "bf16":
        return moment.values.float()
    return reference_dequantise(moment.values, moment.scales, signed)


def _encode(x: torch.Tensor, precision: str, moment: int, step: int) -> list[torch.Tensor]:
    if precision == "bf16":
        return [reference_stochastic_round(x, _noise_at(step, 0, moment, 0, x.numel()))]
    return list(reference_quantise(x, moment == 0, _noise_at(step, 0, moment, 0, x.numel())))


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3], ids=["one-pool-thread", "three-pool-threads"])
def test_one_update_equals_decode_then_torch_adamw_then_encode(precision, grad_dtype, threads, monkeypatch):
    """In pieces of 1,024 elements (monkeypatched from SCRATCH_ELEMS) spread over the pool's threads, as the
    optimizer thread runs it."""
    monkeypatch.setattr(layer_adam, "SCRATCH_ELEMS", 1024)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the pool's size
    try:
        params, optimizer, storage, adam = _unit(precision)
    finally:
        torch.set_num_threads(before)
    assert adam.pool.threads == threads
    grad = torch.randn(storage.trainable_numel, generator=torch.Generator().manual_seed(2)).to(grad_dtype)
    master, moments = _reference_step(storage, optimizer, grad.float(), precision, step=4)
    run_and_compare(adam, DeferredUpdate(0, snapshot(optimizer, 4, None), grad), storage, master, moments)


# ---------------------------------------------------------------------------------------------- training
def _patterned_batches(count: int, seed: int = 4, batch: int = 4, seq: int = 16) -> list[torch.Tensor]:
    """Token streams a tiny model can learn (each token a fixed function of the one before, with some noise),
    so that the loss falls far below log(vocab) and precision shows in it."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.empty(count * batch, seq, dtype=torch.long)
    rows[:, 0] = torch.randint(0, VOCAB, (count * batch,), generator=g)
    for t in range(1, seq):
        noise = torch.rand(count * batch, generator=g) < 0.1
        random = torch.randint(0, VOCAB, (count * batch,), generator=g)
        rows[:, t] = torch.where(noise, random, (rows[:, t - 1] * 7 + 3) % VOCAB)
    return list(rows.split(batch))


class ConstantLR(CausalLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(param_groups(self.model), lr=self.lr)


def held_out_loss_after_training(precision: str, steps: int = 100) -> float:
    """The loss on unseen batches of the same pattern after `steps` of AdamW at a constant 3e-3 (a stable rate:
    at 1e-2 this model's runs differ by several percent from any perturbation, fp32 ones included)."""
    module = ConstantLR(tiny_model("llama", hidden_size=64, intermediate_size=128, seed=4), lr=3e-3)
    trainer(SlideStrategy(moment_precision=precision), steps).fit(
        module, DataLoader(_patterned_batches(steps), batch_size=None))
    with torch.no_grad():
        return sum(float(module.model(input_ids=x, labels=x).loss) for x in _patterned_batches(8, seed=104)) / 8


@pytest.mark.parametrize("precision", COMPACT)
def test_a_hundred_steps_of_compact_moments_end_within_one_and_a_half_percent_of_fp32(precision):
    fp32, compact = held_out_loss_after_training("fp32"), held_out_loss_after_training(precision)
    assert fp32 < 0.3 * math.log(VOCAB)  # it learned: the comparison means something
    assert abs(compact - fp32) <= 0.015 * fp32


# ------------------------------------------------------------------------------------------- disk and resume
def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("master", [False, True], ids=["moments", "master-and-moments"])
def test_compact_moments_on_disk_train_exactly_as_in_ram(precision, master, tmp_path):
    model, batches = tiny_model("qwen3"), token_batches(4)
    in_ram = fit(model, batches, SlideStrategy(moment_precision=precision, chunk_elems=1024), 4)
    on_disk = fit(model, batches, SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0,
                                                nvme_master=master, chunk_elems=1024, moment_precision=precision), 4)
    assert _same_parameters(in_ram.model, on_disk.model)


def test_the_disk_files_of_int8_moments_are_a_quarter_of_fp32s(tmp_path):
    sizes = {}
    for precision in ("fp32", "int8"):
        strategy = SlideStrategy(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, moment_precision=precision)
        fit(tiny_model("llama"), token_batches(1), strategy, 1)
        sizes[precision] = next(e.bytes for e in strategy.plan.entries if e.where == "disk")
    assert sizes["int8"] <= sizes["fp32"] / 4 + 2 * 4096 * 5  # + scales, and each file rounded up to a page


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_resuming_compact_moments_continues_bit_for_bit(precision, tier, tmp_path):
    model, batches = tiny_model("qwen2-tied"), token_batches(4)
    disk = dict(offload="nvme", nvme_path=str(tmp_path / "nvme"), nvme_moments=1.0) if tier == "nvme" else {}
    settings = dict(moment_precision=precision, chunk_elems=1024, **disk)
    straight = CausalLM(copy.deepcopy(model))
    trainer(SlideStrategy(**settings), 6, accumulate=2, default_root_dir=tmp_path, enable_checkpointing=True,
            callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)]).fit(
        straight, DataLoader(batches, batch_size=None))
    resumed = CausalLM(tiny_model("qwen2-tied", seed=9))  # other weights: everything must come from the file
    trainer(SlideStrategy(**settings), 6, accumulate=2, default_root_dir=tmp_path).fit(
        resumed, DataLoader(batches, batch_size=None), ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"))
    assert _same_parameters(straight.model, resumed.model)


def test_an_int8_checkpoint_holds_codes_scales_and_maps(tmp_path):
    module = CausalLM(tiny_model("llama"))
    t = trainer(SlideStrategy(moment_precision="int8"), 2, default_root_dir=tmp_path)
    t.fit(module, DataLoader(token_batches(2), batch_size=None))
    t.save_checkpoint(tmp_path / "int8.ckpt")
    state = torch.load(tmp_path / "int8.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    for entry in state.values():
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.uint8
        n, offset = entry["exp_avg"].numel(), entry["block_offset"]
        assert entry["exp_avg_scale"].numel() == -(-(offset + n) // entry["block_size"])
        assert torch.equal(entry["exp_avg_sq_qmap"], Int8Codec(1).qmap)


# --------------------------------------------------------------------------------------------- conversion
def _engine(model: torch.nn.Module, precision: str) -> tuple[SlideEngine, torch.optim.AdamW]:
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    return SlideEngine(model, optimizer, SlideConfig(moment_precision=precision), torch.device("cpu"),
                       torch.float32), optimizer


def _trained_state(precision: str) -> tuple[torch.nn.Module, SlideEngine, dict]:
    model = tiny_model("llama")
    engine, optimizer = _engine(model, precision)
    engine_steps(engine, model, token_batches(2))
    return model, engine, optimizer.state_dict()


def test_an_fp32_state_loads_into_an_int8_run_quantised():
    model, fp32, state = _trained_state("fp32")
    int8, _ = _engine(tiny_model("llama"), "int8")
    int8.load_optimizer_state(state)
    for source, target in zip(fp32.storages, int8.storages):
        for moment, (key, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False))):
            values = getattr(source, key).values  # encoded as if at step 0
            codes, scales = reference_quantise(values, signed, _noise_at(0, target.index, moment, 0, values.numel()))
            assert torch.equal(getattr(target, key).values, codes) and torch.equal(getattr(target, key).scales, scales)
    assert int8._step == 2
    fp32.close(), int8.close()


@pytest.mark.parametrize("precision", COMPACT)
def test_a_compact_state_loads_into_an_fp32_run_decoded(precision):
    model, compact, state = _trained_state(precision)
    fp32, _ = _engine(tiny_model("llama"), "fp32")
    fp32.load_optimizer_state(state)
    for source, target in zip(compact.storages, fp32.storages):
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            assert torch.equal(getattr(target, key).values, _decode(getattr(source, key), precision, signed=i == 0))
    compact.close(), fp32.close()


def test_an_fp32_checkpoint_resumes_in_an_int8_run(tmp_path):
    """Through Lightning: the run goes on from the checkpoint's step with its moments quantised (each within a
    code's step: rounded stochastically)."""
    model, batches = tiny_model("llama"), token_batches(4)
    trainer("slideformer", 2, default_root_dir=tmp_path, enable_checkpointing=True,
            callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2)]).fit(
        CausalLM(copy.deepcopy(model)), DataLoader(batches, batch_size=None))
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    loaded = {}

    class AtStart(Callback):
        def on_train_start(self, trainer, module):
            state = trainer.strategy.optimizer_state(trainer.optimizers[0])["state"]  # views: copy them now
            loaded.update({i: {k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()}
                           for i, e in state.items()})

    resumed = CausalLM(copy.deepcopy(model))
    trainer(SlideStrategy(moment_precision="int8"), 4, default_root_dir=tmp_path, callbacks=[AtStart()]).fit(
        resumed, DataLoader(batches, batch_size=None), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.trainer.global_step == 4
    for i, entry in saved.items():
        scales, x = _block_scales(loaded[i], "exp_avg"), entry["exp_avg"].reshape(-1)
        assert loaded[i]["exp_avg"].dtype == torch.uint8
        assert torch.all((_dequantised_entry(loaded[i], "exp_avg") - x).abs()
                         <= torch.maximum(x.abs() / 8, 2.0**-17 * scales) * (1 + 1e-5))


def _block_scales(entry: dict, key: str) -> torch.Tensor:
    """The scale of each element's block, from a saved 8-bit moment (moment_state's form)."""
    blocks = (torch.arange(entry[key].numel()) + entry["block_offset"]) // entry["block_size"]
    return entry[f"{key}_scale"][blocks]


def _dequantised_entry(entry: dict, key: str) -> torch.Tensor:
    return entry[f"{key}_qmap"][entry[key].reshape(-1).long()] * _block_scales(entry, key)


# ------------------------------------------------------------------------------------------ what it refuses
def test_amsgrad_with_compact_moments_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="moment_precision='int8'.*amsgrad"):
        fit(tiny_model(), token_batches(1), SlideStrategy(moment_precision="int8"), 1,
            optimizer_kwargs=dict(amsgrad=True))


def test_an_int8_run_needs_gradient_chunks_of_whole_blocks():
    with pytest.raises(ValueError, match="chunk_elems=1100.*multiple of 256"):
        SlideConfig(moment_precision="int8", chunk_elems=1100)


def test_an_unknown_moment_precision_is_refused():
    with pytest.raises(ValueError, match="moment_precision='fp16'.*'int8'"):
        SlideConfig(moment_precision="fp16")


# ---------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("precision, per_param", [("fp32", 12.0), ("bf16", 8.0), ("int8", 6.04)])
def test_the_host_state_of_an_8b_model_per_parameter(precision, per_param):
    """fp32 master (4 B/param) + moments: 8, 4, or 2 plus a 4-byte scale per 256 elements."""
    from transformers import LlamaConfig

    shape = ModelShape.from_config(LlamaConfig(**LLAMA_8B))
    plan = Plan.static(shape, Setup(SlideConfig(moment_precision=precision), device="cpu", dtype=torch.bfloat16))
    state = sum(e.bytes for e in plan.entries if e.what.startswith(("fp32 master", "Adam")))
    assert per_param - 0.03 <= state / shape.numel <= per_param


@pytest.mark.parametrize("precision", COMPACT)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_fabric_loop_saves_compact_moments_with_torch_save_and_loads_them_exactly(precision, tier, tmp_path):
    """A plain loop's `torch.save(optimizer.state_dict())`, then torch's own `optimizer.load_state_dict`, which casts
    the saved moments to fp32 (8-bit codes as numbers) before the engine reads them back: they come back exact."""
    from lightning.fabric import Fabric

    from lightning_slide import SlideFabricStrategy

    disk = dict(offload="nvme", nvme_path=str(tmp_path / "nvme"), nvme_moments=1.0) if tier == "nvme" else {}

    def run(model):
        fabric = Fabric(strategy=SlideFabricStrategy(moment_precision=precision, **disk), accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(param_groups(model), lr=3e-3))
        return model, optimizer, fabric.strategy.engine

    first, optimizer, engine = run(tiny_model("llama"))
    for x in token_batches(2):
        first(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    _, fresh, loaded = run(tiny_model("llama", seed=7))
    fresh.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for saved, back in zip(engine.storages, loaded.storages):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(saved, key).values, getattr(back, key).values)
            assert getattr(saved, key).scales is None or torch.equal(getattr(saved, key).scales,
                                                                     getattr(back, key).scales)
    assert loaded._step == 2
