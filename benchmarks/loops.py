"""The cases that need no Lightning: the machine probe, the fwd+bwd ceiling, plain GPU training.

These are the yardsticks the efficiency targets are judged by, measured in the same run as the
systems they judge: PCIe bandwidth and the CPU AdamW rate give the transfer and update bounds, the
ceiling's FLOP rate gives the GPU compute bound.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.build import build_model, fill_normal_, random_tokens
from benchmarks.cases import CEILINGS, Case
from benchmarks.models import MODELS
from benchmarks.timing import WindowClock

_PCIE_BYTES = 1 << 30  # one copy of the bandwidth probe (1 GiB, pinned)
_PCIE_REPS = 5


def run_probe(case: Case, device: torch.device) -> dict:
    """Pinned host<->device GB/s (each way, and both at once) and CPU fused AdamW params/s."""
    result = {"adam": cpu_adam_rate(case.adam_params)}
    if device.type == "cuda":
        result["pcie"] = pcie_bandwidth(device)
    return result


def cpu_adam_rate(n: int, reps: int = 3) -> dict:
    """`torch.optim.AdamW(fused=True)` on n fp32 CPU params with every CPU thread; median of reps.

    n = 5e8 by default (8 GB of param, grad, m, v: far past any cache): the rate scales to the
    model's N linearly (the same rate holds at 1.07e9 params).
    """
    torch.set_num_threads(os.cpu_count() or 1)
    param = torch.nn.Parameter(torch.empty(n))
    fill_normal_(param.data)
    param.grad = torch.empty(n)
    fill_normal_(param.grad)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    optimizer.step()  # allocates m and v
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"params": n, "threads": torch.get_num_threads(), "step_s": step, "params_per_s": n / step,
            "optimizer": "torch.optim.AdamW(fused=True) on CPU, fp32"}


def pcie_bandwidth(device: torch.device) -> dict:
    """GB/s of 1 GiB pinned copies: host->device, device->host, and both directions at once."""
    hosts = [torch.empty(_PCIE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(_PCIE_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
    return {**copy_rates(hosts, devs), "bytes_per_copy": _PCIE_BYTES}


def copy_rates(hosts: list[torch.Tensor], devs: list[torch.Tensor], reps: int = _PCIE_REPS) -> dict[str, float]:
    """GB/s between two host and two device byte buffers of one size: host->device, device->host, and both at once
    (two streams), each timed over `reps` copies between two device syncs after a warm-up."""
    nbytes = hosts[0].numel()
    streams = [torch.cuda.Stream(devs[0].device), torch.cuda.Stream(devs[0].device)]

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            devs[0].copy_(hosts[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            hosts[1].copy_(devs[1], non_blocking=True)

    def rate(copy: Callable[[], object]) -> float:
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            copy()
        torch.cuda.synchronize()
        return reps * nbytes / (time.perf_counter() - start) / 1e9

    return {"h2d_gbs": rate(lambda: devs[0].copy_(hosts[0], non_blocking=True)),
            "d2h_gbs": rate(lambda: hosts[0].copy_(devs[0], non_blocking=True)), "bidir_gbs": 2 * rate(both)}


def _with_kernels(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The same Triton kernels lightning-slide runs (fused loss: no logits), so baselines differ only in offload."""
    if device.type == "cuda":
        from lightning_slide import ops

        ops.patch(model)
    return model


def make_step(case: Case, device: torch.device, seq_len: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Build the case's model on the device and return its training step (for timed runs and ladders)."""
    ceiling = case.system in CEILINGS
    model = _with_kernels(build_model(MODELS[case.model], seq_len, device,
                                      torch.bfloat16 if ceiling else torch.float32), device)
    if case.system == "ceiling-recompute":
        model.gradient_checkpointing_enable()
    return _ceiling_step(model) if ceiling else _plain_step(model, device)


def _ceiling_step(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """bf16 weights, forward + backward only: the most the GPU can do per token for this model. With gradient
    checkpointing every decoder layer runs its forward again in the backward, as every block does in the engine
    when its graph is not kept (a large step under a VRAM cap): the ceiling of the same work."""
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    return step


def _plain_step(model: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Plain training on one device: fp32 master weights, bf16 autocast, fused AdamW beside them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def run_timed(case: Case, device: torch.device) -> dict:
    """The fwd+bwd ceiling or plain training: warm-up, timed and profiled steps over fixed random tokens
    (already on the device)."""
    step = make_step(case, device, case.seq_len)
    clock = WindowClock(case.warmup, case.steps, device, case.profile_steps)
    data = random_tokens(MODELS[case.model], clock.total_steps * case.micro_batch, case.seq_len,
                         zipf=case.zipf).to(device)
    for batch in data.split(case.micro_batch):
        clock.tick(step(batch))
    return {**clock.summary(case.tokens_per_step),
            "kernels": "ops (lightning-slide Triton kernels, fused loss)" if device.type == "cuda" else "hf-llama-sdpa",
            "first_step_at": clock.first_step_at}
