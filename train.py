"""Fine-tune a causal LM on one device: `python train.py [model=llama3_8b] [offload=cpu|nvme|none] [data=jsonl ...]`.

Writes into the Hydra run dir: CSV and TensorBoard logs, checkpoints/, and hf_model/ (save_pretrained).
"""

import logging
import os
import warnings
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from lightning_slide import SlideStrategy
from lightning_slide.arguments import check_arguments
from lightning_slide.callbacks import HFExport, ThroughputMemoryMonitor
from lightning_slide.checkpoint_io import LinkedLastCheckpoint
from lightning_slide.config import SlideConfig, omegaconf_schema
from lightning_slide.data import TextDataModule, load_tokenizer
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import MODELS, build_model, check_context, load_config, scale_rope

CONF = Path(__file__).resolve().parent / "conf"


def register_configs(store: ConfigStore) -> None:
    """The config nodes that come from the code, not from conf/: `slide_settings`, every SlideConfig field
    with its default and type, which conf/offload/*.yaml extend and only override; and `model=<name>` for
    each architecture of MODELS without a file of its own (conf/model/ holds only recipes that set more)."""
    store.store(name="slide_settings", node=omegaconf_schema())
    for name in MODELS:
        if not (CONF / "model" / f"{name}.yaml").is_file():
            store.store(group="model", name=name, node={"name": name})


register_configs(ConfigStore.instance())


def resolve_precision(precision: str) -> str:
    """"auto" is bf16 mixed precision where the GPU has bf16, and full fp32 on the CPU."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


#: What a setting that a config group leaves open (`???` in its yaml) needs, said the way a user sets it.
REQUIRED = {"data.path": "data=jsonl needs data.path=/path/to/train.jsonl (one JSON object per line), a datasets "
                          "save_to_disk folder, or parquet/arrow files"}


def check_required(cfg: DictConfig) -> None:
    """Settings left open (OmegaConf's `???`) are named before anything reads them as a value."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError("; ".join(REQUIRED.get(key, f"{key} needs a value ({key}=...)") for key in missing) + ".")


#: The offload.* settings only the disk tier reads.
DISK_TIER = ("nvme_path", "nvme_moments", "nvme_master", "gds")


def check_offload_settings(offload: dict) -> None:
    """An offload.* setting changed from its default that the chosen offload never reads is refused, not
    ignored: offload=none runs no sliding runtime, and only offload=nvme has a disk tier."""
    mode, defaults = offload["offload"], asdict(SlideConfig())
    unused = [name for name, value in offload.items() if name in defaults and value != defaults[name]
              and name != "offload" and (mode == "none" or (mode == "cpu" and name in DISK_TIER))]
    if unused:
        reader = "offload=nvme (the disk tier)" if mode == "cpu" else "offload=cpu or nvme (the sliding runtime)"
        given = " ".join(f"offload.{name}={offload[name]}" for name in unused)
        raise ValueError(f"{given}: read only by {reader}, not by offload={mode}. Choose that offload, or drop it.")


def prepare_nvme_path(offload: dict) -> dict:
    """The disk tier's folder, made if missing, so the planner can measure the disk under it; its absolute
    path goes to the strategy. A folder that cannot be made or written is refused here, naming the setting."""
    if offload["offload"] != "nvme" or not offload.get("nvme_path"):
        return offload
    path = Path(offload["nvme_path"]).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    except OSError as error:
        problem = f"{error.strerror}: {error.filename or path}"
    if problem:
        raise ValueError(f"offload.nvme_path={offload['nvme_path']!r} cannot hold the disk tier ({problem}). It must "
                         "be a folder that exists or can be created, on a local disk you can write to, "
                         "e.g. offload.nvme_path=/mnt/nvme/slide.")
    return {**offload, "nvme_path": str(path)}


def make_trainer(settings: dict, **wiring: object) -> L.Trainer:
    """The `trainer.*` settings are lightning.Trainer's own arguments: a wrong one is named with its type."""
    check_arguments(L.Trainer.__init__, settings, "trainer", "lightning.Trainer")
    if settings.get("enable_progress_bar", True) is not False and find_spec("rich") is not None:
        wiring = {**wiring, "callbacks": [*wiring.get("callbacks", []), StepsProgressBar()]}
    try:
        return L.Trainer(**settings, **wiring)
    except (TypeError, ValueError) as error:
        raise ValueError(f"Bad trainer settings ({error}): trainer.* are lightning.Trainer arguments, with their "
                         f"types (e.g. trainer.max_steps=1000). Got {settings}.") from error


class StepsProgressBar(RichProgressBar):
    """Lightning's rich progress bar, minus the "Epoch 0/-2" it shows when max_steps ends the run
    (max_epochs=-1 means no epoch limit; Lightning issue #21925): such a run reads "Epoch 0"."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            description += f"/{self.trainer.max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker


def quiet_library_notices() -> None:
    """What a train.py user cannot act on stays off the screen: the libraries' notices to one another
    (FutureWarnings when transformers, Lightning or torch code calls an API being retired) and Lightning's
    advertisement for its logging service. Warnings about the run itself (UserWarning, Lightning's
    PossibleUserWarning and deprecations of Lightning settings) still show."""
    warnings.filterwarnings("ignore", category=FutureWarning,
                            module=r"(transformers|lightning|lightning_fabric|pytorch_lightning|torch|torchmetrics)\.")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith("💡 Tip"))


def checkpoints(settings: dict, run_dir: Path) -> LinkedLastCheckpoint:
    """The `checkpoint.*` settings are ModelCheckpoint's arguments; the files go to <run dir>/checkpoints
    unless checkpoint.dirpath says otherwise (e.g. a larger disk)."""
    return LinkedLastCheckpoint(**{**settings, "dirpath": settings.get("dirpath") or run_dir / "checkpoints"})


def resolve(cfg: DictConfig) -> dict:
    """The composed config as plain values, settled once before anything is built: open values named,
    settings the chosen offload would ignore refused, the disk tier's folder made, precision "auto" and the
    learning rate decided."""
    check_required(cfg)
    c = OmegaConf.to_container(cfg, resolve=True)
    check_offload_settings(c["offload"])
    c["offload"] = prepare_nvme_path(c["offload"])
    c["trainer"] = {**c["trainer"], "precision": resolve_precision(c["trainer"]["precision"])}
    scratch_lr = c["model"].pop("scratch_lr")
    c["optim"] = {**c["optim"], "lr": learning_rate(c["optim"]["lr"], scratch_lr, c["model"]["pretrained"])}
    return c


FINE_TUNING_LR = 1e-5  # a full fine-tuning rate for billion-parameter models


def learning_rate(lr: float | None, scratch_lr: float | None, pretrained: str | None) -> float:
    """`optim.lr` where set; else a model recipe's rate for training from scratch (`model.scratch_lr`) where there
    are no pretrained weights to keep, and the fine-tuning rate otherwise."""
    if lr is not None:
        return lr
    return scratch_lr if scratch_lr is not None and pretrained is None else FINE_TUNING_LR


def model_config_for(model: dict, seq_len: int) -> object:
    """The model's HF config with `model.rope_scaling` applied (checking a pretrained folder first), refused when
    data.seq_len passes its positions: nothing is built or allocated before this."""
    config = load_config(model["name"], model["pretrained"])
    if model.get("rope_scaling"):
        config = scale_rope(config, model["rope_scaling"])
    check_context(config, seq_len, model["pretrained"] or model["name"])
    return config


def train(cfg: DictConfig, run_dir: Path) -> L.Trainer:
    """One fine-tuning run of the composed config, writing everything under `run_dir`."""
    c = resolve(cfg)
    L.seed_everything(c["seed"])
    sliding = c["offload"]["offload"] != "none"  # the engine fills meta placeholders unit by unit
    model = build_model(model_config_for(c["model"], c["data"]["seq_len"]), c["model"]["pretrained"], meta=sliding)
    tokenizer = load_tokenizer(c["model"]["pretrained"])
    module = CausalLMModule(model, **c["optim"])
    trainer = make_trainer(
        c["trainer"],
        strategy=SlideStrategy(**c["offload"]),  # offload=none: plain single-device training
        default_root_dir=run_dir,
        logger=[CSVLogger(run_dir, name="csv", version=""), TensorBoardLogger(run_dir, name="tensorboard", version="")],
        enable_checkpointing=c["checkpoint"] is not None,  # checkpoint=null: no checkpoints (e.g. too little disk)
        callbacks=[
            *([checkpoints(c["checkpoint"], run_dir)] if c["checkpoint"] is not None else []),
            ThroughputMemoryMonitor(),
            *([HFExport(run_dir / "hf_model", tokenizer, **c["export"])] if c["export"] is not None else []),
        ],
    )
    trainer.fit(module, datamodule=TextDataModule(tokenizer, seed=c["seed"], **c["data"]), ckpt_path=c["resume"])
    return trainer


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    quiet_library_notices()
    train(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
