"""The LightningModule for causal-LM fine-tuning: loss from the HF model, AdamW, warmup + cosine LR.

Parameters are touched only inside the model's own forward (and by shape when grouping for the optimizer),
because the sliding runtime streams each block's weights in just for its forward call.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from transformers import PreTrainedModel, get_cosine_with_min_lr_schedule_with_warmup

from lightning_slide.data import IGNORE_INDEX
from lightning_slide.packing import model_inputs

# No argument validation: it would look at every target on the host, a device sync per step.
_ACC = dict(average="micro", ignore_index=IGNORE_INDEX, validate_args=False)
VAL_LOGITS_BYTES = 256 * 2**20  # the fp32 logits validation holds at once


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases (ndim < 2) are scale/offset terms that decay would distort."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class CausalLMModule(L.LightningModule):
    """Full-parameter fine-tuning of a Hugging Face causal LM: batches of input_ids, labels and either the
    attention_mask of padded rows or the position_ids of packed ones (`packing.py`). The default `lr` is a full
    fine-tuning rate for billion-parameter models; a small model trained from scratch wants a higher one."""

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float = 1e-5,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if lr <= 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"Bad optimizer settings lr={lr}, warmup_steps={warmup_steps}, "
                             f"min_lr_ratio={min_lr_ratio}: set optim.lr > 0, optim.warmup_steps >= 0 "
                             "and 0 <= optim.min_lr_ratio <= 1.")
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        vocab = model.config.get_text_config().vocab_size
        self.train_acc = MulticlassAccuracy(vocab, **_ACC)
        self.val_acc = MulticlassAccuracy(vocab, **_ACC)
        self.val_nll = MeanMetric()  # per-token NLL: val/loss, and val/ppl = exp(val/loss)

    def on_fit_start(self) -> None:
        """Metric states follow the compute device even when the strategy leaves the weights on the host."""
        for metric in (self.train_acc, self.val_acc, self.val_nll):
            metric.to(self.device)

    def on_validation_start(self) -> None:
        """As `on_fit_start`, for a `trainer.validate` of its own."""
        self.on_fit_start()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The global RNG states (Lightning saves none), so dropout after a resume draws what it would have."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        checkpoint["rng_states"] = {"torch": torch.get_rng_state(), "cuda": cuda}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._rng_states = checkpoint.get("rng_states")

    def on_train_start(self) -> None:
        """Saved RNG states are set only now: the strategy's setup draws from them (initialising placeholders)."""
        states, self._rng_states = getattr(self, "_rng_states", None), None
        if states is not None:
            torch.set_rng_state(states["torch"])
            if states["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(states["cuda"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**model_inputs(batch, self.model), labels=batch["labels"])
        self.log("train/loss", out.loss, prog_bar=True)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        if out.logits is not None:  # None when a fused linear-cross-entropy kernel computed the loss
            self.train_acc(out.logits[:, :-1].argmax(-1), batch["labels"][:, 1:])
            self.log("train/acc", self.train_acc)
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Per-token NLL and accuracy from the decoder's hidden states, with the output head applied to a slice of
        tokens at a time: whole fp32 logits of 8 x 1024 tokens at a 128,256-token vocabulary take 3.9 GiB, more
        than a 24 GB card has beside an 8B model's window."""
        targets = batch["labels"][:, 1:].flatten()
        rows = max(1, VAL_LOGITS_BYTES // (4 * self.val_acc.num_classes))
        for start, logits in self._logit_slices(batch, rows):
            logits, wanted = logits.float(), targets[start : start + len(logits)]
            nll = F.cross_entropy(logits, wanted, ignore_index=IGNORE_INDEX, reduction="none")
            self.val_nll.update(nll[wanted != IGNORE_INDEX])
            self.val_acc.update(logits.argmax(-1), wanted)

    def _logit_slices(self, batch: dict[str, torch.Tensor], rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first token, logits) of `rows` next-token predictions at a time; a model that is not a Hugging Face
        causal LM (no decoder / output head to call apart) gives its whole logits as one slice."""
        inputs = model_inputs(batch, self.model)
        if not (hasattr(self.model, "get_decoder") and hasattr(self.model, "get_output_embeddings")):
            yield 0, self.model(**inputs).logits[:, :-1].flatten(0, 1)
            return
        head = self.model.get_output_embeddings()
        hidden = self.model.get_decoder()(**inputs).last_hidden_state[:, :-1].flatten(0, 1)
        for start in range(0, len(hidden), rows):
            yield start, head(hidden[start : start + rows])

    def on_validation_epoch_end(self) -> None:
        nll = self.val_nll.compute()
        self.log_dict({"val/loss": nll, "val/ppl": nll.exp(), "val/acc": self.val_acc.compute()}, prog_bar=True)
        self.val_nll.reset()
        self.val_acc.reset()

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        optimizer = torch.optim.AdamW(adamw_param_groups(self.model, hp.weight_decay), lr=hp.lr, betas=hp.betas)
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, hp.warmup_steps, self.trainer.estimated_stepping_batches, min_lr_rate=hp.min_lr_ratio
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
