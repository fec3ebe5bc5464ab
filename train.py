"""Fine-tune a causal LM on one device: `python train.py [model=llama3_8b] [offload=cpu|nvme|none] [data=jsonl ...]`.

Writes into the Hydra run dir: CSV and TensorBoard logs, checkpoints/, and hf_model/ (save_pretrained).
"""

from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from lightning_slide import SlideStrategy
from lightning_slide.callbacks import HFExport, ThroughputMemoryMonitor
from lightning_slide.data import TextDataModule, load_tokenizer
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import build_model


def resolve_precision(precision: str) -> str:
    """"auto" is bf16 mixed precision where the GPU has bf16, and full fp32 on the CPU."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def make_trainer(settings: dict, **wiring: object) -> L.Trainer:
    """The `trainer.*` settings are lightning.Trainer's own arguments: a wrong one is named with the settings."""
    try:
        return L.Trainer(**settings, **wiring)
    except (TypeError, ValueError) as error:
        raise ValueError(f"Bad trainer settings ({error}): trainer.* are lightning.Trainer arguments, with their "
                         f"types (e.g. trainer.max_steps=1000). Got {settings}.") from error


def train(cfg: DictConfig, run_dir: Path) -> L.Trainer:
    """One fine-tuning run of the composed config, writing everything under `run_dir`."""
    c = OmegaConf.to_container(cfg, resolve=True)
    L.seed_everything(c["seed"])
    sliding = c["offload"]["offload"] != "none"  # the engine fills meta placeholders unit by unit
    model = build_model(c["model"]["name"], c["model"]["pretrained"], meta=sliding)  # checks the folder first
    tokenizer = load_tokenizer(c["model"]["pretrained"])
    module = CausalLMModule(model, **c["optim"])
    trainer = make_trainer(
        {**c["trainer"], "precision": resolve_precision(c["trainer"]["precision"])},
        strategy=SlideStrategy(**c["offload"]),  # offload=none: plain single-device training
        default_root_dir=run_dir,
        logger=[CSVLogger(run_dir, name="csv", version=""), TensorBoardLogger(run_dir, name="tensorboard", version="")],
        callbacks=[
            ModelCheckpoint(run_dir / "checkpoints", **c["checkpoint"]),
            ThroughputMemoryMonitor(),
            HFExport(run_dir / "hf_model", tokenizer),
        ],
    )
    trainer.fit(module, datamodule=TextDataModule(tokenizer, seed=c["seed"], **c["data"]), ckpt_path=c["resume"])
    return trainer


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
