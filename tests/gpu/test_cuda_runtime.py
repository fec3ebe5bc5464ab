"""The runtime on a real GPU: streams, pinned memory, kernels; same answers, no allocation after warm-up."""


import pytest
import torch

from lightning_slide import SlideConfig, SlideEngine
from tests.runtime.helpers import fit, param_groups, reference, relative_difference, tiny_model, token_batches

pytestmark = pytest.mark.gpu
STEPS = 5


def test_fp32_on_cuda_matches_adamw_without_kernels():
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("qwen2-tied"), token_batches(STEPS * 2)
    expected = reference(model, batches, STEPS, accumulate=2, clip=0.5, device="cuda")
    got = fit(model, batches, SlideStrategy(use_kernels=False), STEPS, accumulate=2, clip=0.5, accelerator="gpu")
    assert relative_difference(expected, got.model) <= 1e-5


@pytest.mark.parametrize(
    "settings",
    [dict(offload="nvme", nvme_moments=1.0, activations="nvme", chunk_elems=4096), dict(slots="auto")],
    ids=["disk-tier", "auto-window"],
)
def test_every_tier_and_window_on_cuda_gives_the_cpu_tiers_parameters(settings, tmp_path):
    from lightning_slide import SlideStrategy

    model, batches = tiny_model("llama", num_hidden_layers=6), token_batches(STEPS * 2)
    base = fit(model, batches, SlideStrategy(use_kernels=False), STEPS, accumulate=2, accelerator="gpu")
    if settings.get("offload") == "nvme":
        settings = {**settings, "nvme_path": str(tmp_path)}
    other = fit(model, batches, SlideStrategy(use_kernels=False, **settings), STEPS, accumulate=2, accelerator="gpu")
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


@pytest.mark.parametrize("settings", [dict(activations="device"), dict(activations="cpu"), dict(slots="auto")],
                         ids=["device", "cpu", "auto-window"])
def test_no_device_allocation_after_warm_up(settings):
    model = tiny_model("llama", num_hidden_layers=6)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    engine = SlideEngine(model, opt, SlideConfig(**settings), torch.device("cuda"), torch.bfloat16)
    batches = [x.cuda() for x in token_batches(6)]

    def step(x):
        engine.new_micro_batch()
        engine.begin_step()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        engine.end_step()

    for x in batches[:2]:
        step(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for x in batches[2:]:
        step(x)
    engine.synchronize()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    engine.close()
    assert after["segment.all.allocated"] == before["segment.all.allocated"], "cudaMalloc after warm-up"
    assert after["num_alloc_retries"] == before["num_alloc_retries"]


def test_master_weights_are_pinned_and_unpinned_at_close():
    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()), SlideConfig(), torch.device("cuda"),
                         torch.bfloat16)
    assert all(s.pinned for s in engine.storages)
    engine.close()
    assert not any(s.pinned for s in engine.storages)
