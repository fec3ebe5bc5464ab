"""Tiny real architectures, a LightningModule around them, and the plain-PyTorch reference they must match."""

from __future__ import annotations

import copy
import math

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import lightning_slide  # noqa: F401  (registers strategy="slideformer")

VOCAB, SEQ = 97, 16
_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
ARCHS = {
    "llama": lambda **kw: LlamaForCausalLM(LlamaConfig(**{**_SHAPE, **kw}, tie_word_embeddings=False)),
    "qwen2-tied": lambda **kw: Qwen2ForCausalLM(Qwen2Config(**{**_SHAPE, **kw}, tie_word_embeddings=True)),
    "mistral": lambda **kw: MistralForCausalLM(MistralConfig(**{**_SHAPE, **kw}, tie_word_embeddings=False,
                                                             sliding_window=None)),
    "qwen3": lambda **kw: Qwen3ForCausalLM(Qwen3Config(**{**_SHAPE, **kw}, head_dim=8, tie_word_embeddings=True)),
}


def tiny_model(arch: str = "llama", seed: int = 0, **shape: object) -> torch.nn.Module:
    """A randomly initialised tiny model of a real architecture; `shape` overrides config fields."""
    torch.manual_seed(seed)
    return ARCHS[arch](**shape)


def token_batches(count: int, batch: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(count)]


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """The usual LLM recipe: no weight decay on norms and biases (frozen parameters left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 ** (step / 4)


class CausalLM(LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 3e-3, optimizer: type = torch.optim.AdamW,
                 **optimizer_kwargs) -> None:
        super().__init__()
        self.model, self.lr, self.optimizer_cls, self.optimizer_kwargs = model, lr, optimizer, optimizer_kwargs

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        opt = self.optimizer_cls(param_groups(self.model), lr=self.lr, **self.optimizer_kwargs)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SkipsBatches(CausalLM):
    """Returns None for some batches: Lightning then runs no backward for them."""

    def __init__(self, model: torch.nn.Module, skip: set[int]) -> None:
        super().__init__(model)
        self.skip = skip

    def training_step(self, batch: torch.Tensor, batch_idx: int):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.skip else loss


class EmbedsOutside(CausalLM):
    """Feeds inputs_embeds made without the model's embedding: that unit gets no gradient."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(batch_idx)
        embeds = torch.randn(*batch.shape, self.model.config.hidden_size, generator=g)
        return self.model(inputs_embeds=embeds, labels=batch).loss


def trainer(strategy, steps: int, accumulate: int = 1, clip: float | None = None, precision: str = "32-true",
            **kwargs) -> Trainer:
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, accelerator="cpu", devices=1)
    return Trainer(strategy=strategy, max_steps=steps, precision=precision, accumulate_grad_batches=accumulate,
                   gradient_clip_val=clip, **{**settings, **kwargs})


def fit(model: torch.nn.Module, batches: list[torch.Tensor], strategy, steps: int,
        optimizer: type = torch.optim.AdamW, optimizer_kwargs: dict | None = None, **kwargs) -> CausalLM:
    module = CausalLM(copy.deepcopy(model), optimizer=optimizer, **(optimizer_kwargs or {}))
    trainer(strategy, steps, **kwargs).fit(module, DataLoader(batches, batch_size=None))
    return module


def engine_steps(engine, model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    """Train through the engine's step protocol as a plain loop does (no Lightning): one backward per step."""
    for x in batches:
        engine.new_micro_batch()
        engine.begin_step()
        model(input_ids=x, labels=x).loss.backward()
        engine.end_step()
        engine.synchronize()


def adamw_steps(model: torch.nn.Module, batches: list[torch.Tensor], lr: float = 1e-2) -> torch.nn.Module:
    """A copy of `model` after `engine_steps` over `batches` as `torch.optim.AdamW` alone trains it."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(param_groups(model), lr=lr)
    for x in batches:
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def reference(model: torch.nn.Module, batches: list[torch.Tensor], steps: int, accumulate: int = 1,
              clip: float | None = None, optimizer: type = torch.optim.AdamW, device: str = "cpu",
              optimizer_kwargs: dict | None = None) -> torch.nn.Module:
    """The same training as a plain PyTorch loop: loss / accumulate, clip_grad_norm_, step, scheduler."""
    model = copy.deepcopy(model).to(device)
    opt = optimizer(param_groups(model), lr=3e-3, **(optimizer_kwargs or {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
    for step in range(steps):
        for x in batches[step * accumulate : (step + 1) * accumulate]:
            x = x.to(device)
            (model(input_ids=x, labels=x).loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model


def relative_difference(a: torch.nn.Module, b: torch.nn.Module, per_tensor_limit: float = 1e-3) -> float:
    """||a - b|| / ||a|| over all parameters as one vector.

    Each tensor must also agree within `per_tensor_limit`: looser, because a few parameters get a gradient
    that is zero up to rounding (e.g. a key-projection bias, to which softmax is invariant), and Adam turns
    rounding noise into full-size steps there.
    """
    num = den = 0.0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        p, q = p.detach().double().cpu(), q.detach().double().cpu()
        diff = float((p - q).norm())
        assert math.isfinite(diff), f"{name} is not finite"
        assert diff <= per_tensor_limit * float(p.norm()), f"{name} differs by {diff / float(p.norm()):.2e}"
        num, den = num + diff**2, den + float(p.norm()) ** 2
    return math.sqrt(num / den)


def assert_same_state(a_engine, b_engine) -> None:
    """Two engines' flat state bit for bit: every unit's master and both moments (values and scales)."""
    for a, b in zip(a_engine.storages, b_engine.storages):
        assert torch.equal(a.master, b.master), a.name
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = getattr(a, key), getattr(b, key)
            assert torch.equal(x.values, y.values) and (x.scales is None or torch.equal(x.scales, y.scales)), a.name
