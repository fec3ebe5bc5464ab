"""The settings a user meets are SlideConfig's: the README's settings table, its `python train.py` command lines,
and SlideStrategy's arguments (a SlideConfig, keywords, or both)."""

import ast
import re
import runpy
import shlex
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from lightning.pytorch import Trainer
from omegaconf import OmegaConf

from lightning_slide import SlideStrategy
from lightning_slide.config import SlideConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
runpy.run_path(str(ROOT / "train.py"))  # registers the config nodes train.py makes from the code


def config(*overrides: str):
    """The config `python train.py <overrides>` composes."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def settings_table() -> list[tuple[str, object]]:
    """(name, default) of each row of the README's settings table, in order."""
    section = README.split("### Settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.M)
    return [(name, ast.literal_eval(default)) for name, default in rows]


def readme_commands() -> list[list[str]]:
    """The arguments of every `python train.py ...` line in the README's shell blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("python train.py")]


def test_the_readme_settings_table_has_one_row_per_slide_config_field_with_its_default():
    assert settings_table() == [(f.name, f.default) for f in fields(SlideConfig)]


@pytest.mark.parametrize("overrides", readme_commands(), ids=" ".join)
def test_every_train_py_command_line_of_the_readme_composes(overrides):
    cfg = config(*overrides)
    assert SlideConfig.from_kwargs(**OmegaConf.to_container(cfg.offload)).offload == cfg.offload.offload


def test_the_readme_shows_train_py_commands_for_models_tiers_and_settings():
    joined = [" ".join(args) for args in readme_commands()]
    for override in ("model=llama3_8b", "offload=nvme", "offload.nvme_path=", "model.pretrained=", "offload.slots=4",
                     "checkpoint=null", "resume="):
        assert any(override in command for command in joined), override


def test_a_strategy_takes_a_slide_config_and_keywords_override_its_fields():
    strategy = SlideStrategy(SlideConfig(slots=4, recompute="always"), recompute="never", activations="cpu")
    assert strategy.config == SlideConfig(slots=4, recompute="never", activations="cpu")


def test_the_strategy_without_settings_has_slide_config_defaults():
    assert SlideStrategy().config == SlideConfig()


def test_the_registered_disk_tier_strategy_is_offload_nvme():
    trainer = Trainer(strategy="slideformer_nvme", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.config.offload == "nvme"
    assert trainer.strategy.config.nvme_path  # the system temporary directory unless set


def test_an_unknown_strategy_keyword_is_refused_with_the_valid_settings():
    with pytest.raises(TypeError, match=r"Unknown slideformer setting\(s\) \['window'\].*'slots'"):
        SlideStrategy(SlideConfig(), window=3)


@pytest.mark.parametrize("value", [-1, "many", 1.5, True])
def test_gpu_update_blocks_takes_a_count_or_auto_and_names_both_when_refused(value):
    assert SlideConfig(gpu_update_blocks="auto").gpu_update_blocks == "auto"
    with pytest.raises(ValueError, match=r"SlideConfig.gpu_update_blocks=.* is not valid.*or 'auto'"):
        SlideConfig(gpu_update_blocks=value)
