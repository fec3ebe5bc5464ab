"""Kept graphs (recompute="never"/"auto"): the backward reuses the forward's graph and must train exactly as
recomputing does, with the weights read back from whichever slot holds them at backward time."""

import gc

import pytest
import torch
from lightning.pytorch import Callback

from lightning_slide import SlideStrategy
from lightning_slide.graphs import GraphBudget, SlotViews
from tests.runtime.helpers import fit, tiny_model, token_batches

STEPS = 3


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kept_graphs_train_bit_identically_to_recomputing(arch):
    model, batches = tiny_model(arch), token_batches(STEPS * 2)
    recomputed = fit(model, batches, SlideStrategy(recompute="always", slots=2), STEPS, accumulate=2, clip=0.5)
    kept = fit(model, batches, SlideStrategy(recompute="never", slots=2), STEPS, accumulate=2, clip=0.5)
    assert all(torch.equal(a, b) for a, b in zip(_params(recomputed.model), _params(kept.model)))


def test_kept_graphs_reuse_the_forwards_dropout_masks():
    model, batches = tiny_model("llama", attention_dropout=0.3), token_batches(STEPS)
    torch.manual_seed(5)
    recomputed = fit(model, batches, SlideStrategy(recompute="always"), STEPS)
    torch.manual_seed(5)
    kept = fit(model, batches, SlideStrategy(recompute="never"), STEPS)
    assert all(torch.equal(a, b) for a, b in zip(_params(recomputed.model), _params(kept.model)))


class _LiveGraphs(Callback):
    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gc.collect()
        live = sum(isinstance(o, SlotViews) for o in gc.get_objects())
        self.counts.append((live, trainer.strategy.engine.graphs.used))


def test_a_kept_graph_is_freed_by_its_backward():
    probe = _LiveGraphs()
    fit(tiny_model("qwen2-tied"), token_batches(STEPS), SlideStrategy(recompute="never", slots=2), STEPS,
        callbacks=[probe])
    assert probe.counts == [(0, 0)] * STEPS


def test_auto_recomputes_until_a_part_has_been_measured_and_memory_granted():
    budget, part, empty = GraphBudget("auto"), object(), object()
    assert budget.admit(part, 100) is None
    budget.measured(part, 1000, 100)
    budget.measured(empty, 0, 100)
    assert budget.admit(part, 100) is None  # measured, but no memory granted yet
    assert budget.admit(empty, 100) is None  # even a graph measured at nothing (off CUDA)
    budget.allow(2500)
    assert budget.admit(part, 100) == 1000


def test_auto_keeps_graphs_in_call_order_while_their_scaled_estimates_fit():
    budget, first, second = GraphBudget("auto"), object(), object()
    budget.measured(first, 1000, 100)
    budget.measured(second, 400, 100)
    budget.allow(2500)
    assert budget.admit(first, 200) == 2000  # twice the input elements: twice the graph
    assert budget.admit(second, 200) is None  # 2000 + 800 > 2500
    assert budget.admit(second, 100) == 400
    budget.release(2000)
    assert budget.used == 400


def test_always_never_keeps_and_never_always_keeps():
    always, never = GraphBudget("always"), GraphBudget("never")
    for budget in (always, never):
        budget.measured("part", 10, 1)
        budget.allow(1e12)
    assert always.admit("part", 1) is None
    assert never.admit("part", 10**9) == 0


def test_kept_graphs_beside_the_disk_tier_train_bit_identically_to_recomputing(tmp_path):
    model, batches = tiny_model("llama"), token_batches(STEPS)
    disk = dict(offload="nvme", nvme_path=str(tmp_path), nvme_moments=1.0, activations="nvme", chunk_elems=1024)
    recomputed = fit(model, batches, SlideStrategy(recompute="always", **disk), STEPS)
    kept = fit(model, batches, SlideStrategy(recompute="never", **disk), STEPS)
    assert all(torch.equal(a, b) for a, b in zip(_params(recomputed.model), _params(kept.model)))


def test_auto_recomputes_everything_off_cuda():
    strategy = SlideStrategy()  # recompute="auto": no device memory to spend on the CPU
    kept = []
    strategy.teardown = lambda: (kept.append(strategy.engine.stats()["kept_graphs"]), SlideStrategy.teardown(strategy))
    fit(tiny_model("llama"), token_batches(STEPS), strategy, STEPS)
    assert kept == [0]


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_a_forward_without_gradients_keeps_neither_graphs_nor_inputs(recompute):
    """Evaluation (no_grad) has no backward: no call records a graph or copies its input out."""
    from lightning_slide import SlideConfig, SlideEngine

    model = tiny_model("llama")
    engine = SlideEngine(model, torch.optim.AdamW(model.parameters()),
                         SlideConfig(recompute=recompute, activations="cpu"), torch.device("cpu"), torch.float32)
    x = token_batches(1)[0]
    with torch.no_grad():
        engine.new_micro_batch()
        model(input_ids=x, labels=x)
    assert engine.graphs.kept == 0 and engine.activations.bytes_out == 0
    engine.close()
