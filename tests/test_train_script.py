"""train.py end to end: a short run learns and writes logs, checkpoints and an HF folder; bad settings fail clearly."""

import csv
import json
import os
import runpy
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_slide.callbacks import ThroughputMemoryMonitor
from lightning_slide.config import SlideConfig
from lightning_slide.data import byte_tokenizer
from lightning_slide.models import MODELS, build_model, model_config

ROOT = Path(__file__).resolve().parents[1]
SHORT_RUN = ["trainer.max_steps=30", "trainer.val_check_interval=15", "trainer.log_every_n_steps=3",
             "+trainer.limit_val_batches=2"]
SCRIPT = runpy.run_path(str(ROOT / "train.py"))
train = SCRIPT["train"]


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture(scope="module", params=["none", "cpu"])
def offload(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def run_dir(offload, tmp_path_factory) -> Path:
    """`python train.py` as a user runs it, shortened to 30 steps."""
    out = tmp_path_factory.mktemp(f"run-{offload}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "train.py", f"offload={offload}", f"hydra.run.dir={out}", *SHORT_RUN]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def logged(run_dir: Path, key: str) -> list[float]:
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return [float(row[key]) for row in rows if row.get(key)]


def test_loss_falls(run_dir):
    losses = logged(run_dir, "train/loss")
    assert len(losses) >= 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5


def test_logs_lr_throughput_memory_and_validation_metrics(run_dir):
    for key in ("lr", "tokens/s", "rss_peak_GiB", "train/acc", "val/loss", "val/ppl", "val/acc"):
        assert logged(run_dir, key), key
    assert min(logged(run_dir, "tokens/s")) > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_writes_a_checkpoint_at_the_last_step(run_dir):
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 30


def test_hf_folder_reloads_as_the_trained_model(run_dir):
    trained = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", local_files_only=True).eval()
    assert list((run_dir / "hf_model").glob("*.safetensors"))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight  # the tie survived export
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, trained[f"model.{name}"], rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf_model", local_files_only=True)
    assert tokenizer.decode(tokenizer("def f(x):")["input_ids"]) == "def f(x):"


def test_resume_continues_from_the_checkpoint(run_dir, offload, tmp_path):
    cfg = config(f"offload={offload}", f"resume={run_dir / 'checkpoints' / 'last.ckpt'}", *SHORT_RUN[1:],
                 "trainer.max_steps=32")
    assert train(cfg, tmp_path).global_step == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU default")
def test_precision_auto_means_fp32_on_cpu_and_explicit_values_pass_through():
    assert SCRIPT["resolve_precision"]("auto") == "32-true"
    assert SCRIPT["resolve_precision"]("bf16-mixed") == "bf16-mixed"


def test_unknown_model_lists_available_models():
    with pytest.raises(MissingConfigException, match="(?s)Available options in 'model'.*llama3_8b.*qwen3_14b"):
        config("model=llama9_1t")


def test_unknown_setting_is_refused():
    with pytest.raises(ConfigCompositionException, match="Could not override 'trainer.max_stepz'"):
        config("trainer.max_stepz=10")


def test_bad_value_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="data.seq_len >= 2"):
        train(config("offload=none", "data.seq_len=0"), tmp_path)


@pytest.mark.parametrize("tier", [["offload=none"], ["offload=nvme", "offload.nvme_moments=0.5"]], ids=["none", "nvme"])
def test_fine_tunes_a_local_pretrained_folder_on_prompt_response_jsonl(tier, tmp_path):
    """With the sliding runtime the model is built on meta and filled from the folder, unit by unit. The export
    keeps the folder's generation settings (stop ids, sampling) and its config's use_cache."""
    from transformers import GenerationConfig

    pretrained = tmp_path / "pretrained"
    build_model(model_config("tiny", num_hidden_layers=1)).save_pretrained(pretrained)
    GenerationConfig(eos_token_id=[1, 0], do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(pretrained)
    byte_tokenizer().save_pretrained(pretrained)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}? ", "response": f"A{i * i}."}) + "\n" for i in range(40)))
    nvme = tmp_path / "nvme"
    cfg = config(*tier, f"+offload.nvme_path={nvme}" if "offload=nvme" in tier else "seed=0",
                 f"model.pretrained={pretrained}", "data=jsonl", f"data.path={data}",
                 "data.batch_size=4", "trainer.max_steps=4", "trainer.val_check_interval=4")
    trainer = train(cfg, tmp_path / "run")
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model", local_files_only=True)
    assert tuned.config.num_hidden_layers == 1 and tuned.config.use_cache
    generation = tuned.generation_config
    assert (generation.eos_token_id, generation.do_sample, generation.temperature, generation.top_p) == (
        [1, 0], True, 0.6, 0.9)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    assert not nvme.exists() or not any(nvme.iterdir())


def test_a_pretrained_path_that_is_no_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.pretrained=.* is not a local Hugging Face model folder"):
        train(config("offload=none", f"model.pretrained={tmp_path / 'missing'}"), tmp_path)


def test_a_trainer_setting_of_the_wrong_type_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.max_steps='many' must be an int"):
        train(config("offload=none", "trainer.max_steps=many"), tmp_path)


def test_bad_offload_setting_is_refused_by_the_strategy(tmp_path):
    with pytest.raises(ValueError, match="SlideConfig.slots=1 is not valid"):
        train(config("offload=cpu", "offload.slots=1"), tmp_path)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": \n')
    with pytest.raises(ValueError, match=r"train\.jsonl:2: not valid JSON"):
        train(config("offload=none", "data=jsonl", f"data.path={path}"), tmp_path)


def test_every_registered_architecture_is_a_model_choice_and_every_recipe_one_of_them():
    assert {p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")} <= set(MODELS)
    assert all(config(f"model={name}").model.name == name for name in MODELS)


@pytest.mark.parametrize("overrides, lr", [
    ((), 3e-3),  # tiny from scratch: its recipe's rate
    (("model=llama3_8b",), 1e-5),
    (("model.pretrained=/models/tiny-chat",), 1e-5),  # pretrained weights: the fine-tuning rate, whatever the recipe
    (("model=llama3_8b", "optim.lr=2e-5"), 2e-5),
    (("model.pretrained=/models/tiny-chat", "optim.lr=2e-5"), 2e-5),
], ids=["tiny-from-scratch", "8b", "pretrained", "8b-lr-set", "pretrained-lr-set"])
def test_the_learning_rate_is_the_command_lines_else_a_scratch_recipes_else_the_fine_tuning_rate(overrides, lr):
    assert SCRIPT["resolve"](config(*overrides))["optim"]["lr"] == lr


@pytest.mark.parametrize("offload", ["cpu", "nvme", "none"])
def test_each_offload_choice_is_every_slide_config_setting_at_its_default(offload):
    settings = OmegaConf.to_container(config(f"offload={offload}").offload)
    assert settings == asdict(SlideConfig(offload=offload))


def test_offload_settings_reach_the_strategy_with_their_types():
    c = config("offload=nvme", "offload.slots=4", "offload.loss_chunk_mib=256", "offload.nvme_moments=0.5")
    assert SlideConfig.from_kwargs(**OmegaConf.to_container(c.offload)) == SlideConfig(
        offload="nvme", slots=4, loss_chunk_mib=256.0, nvme_moments=0.5)


def test_an_offload_setting_of_the_wrong_type_is_refused_when_composed_with_its_key():
    with pytest.raises(ConfigCompositionException, match=r"offload\.chunk_elems=abc") as error:
        config("offload.chunk_elems=abc")
    assert "could not be converted to Integer" in str(error.value.__cause__)


@pytest.mark.parametrize("overrides, message", [
    (["offload=cpu", "offload.nvme_path=/mnt/nvme"], r"offload\.nvme_path=/mnt/nvme: read only by offload=nvme"),
    (["offload=none", "offload.slots=4"], r"offload\.slots=4: read only by offload=cpu or nvme"),
], ids=["disk-tier-setting-on-cpu", "sliding-setting-on-none"])
def test_a_setting_the_chosen_offload_does_not_read_is_refused_before_building(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        train(config(*overrides), tmp_path)


def test_a_sequence_past_the_models_positions_is_refused_naming_rope_scaling_before_anything_is_built(
        tmp_path, monkeypatch):
    built = []
    monkeypatch.setitem(train.__globals__, "build_model", lambda *args, **kwargs: built.append(args))
    with pytest.raises(ValueError, match=r"data\.seq_len=262144 exceeds llama3_3b's max_position_embeddings=131072; "
                                         r"set model\.rope_scaling"):
        train(config("model=llama3_3b", "data.seq_len=262144"), tmp_path)
    assert built == []


def test_model_rope_scaling_on_the_command_line_grows_the_positions_the_sequence_is_checked_against():
    cfg = config("model=llama3_3b", "data.seq_len=262144", "model.rope_scaling={factor:64.0}")
    model = SCRIPT["model_config_for"](OmegaConf.to_container(cfg.model), cfg.data.seq_len)
    assert model.max_position_embeddings == 262144 and model.rope_parameters["factor"] == 64.0


def test_export_settings_shape_the_hf_folder(tmp_path):
    train(config("offload=cpu", "trainer.max_steps=1", "trainer.val_check_interval=1", "+trainer.limit_val_batches=1",
                 "export.dtype=bfloat16", "export.max_shard_size=300KB"), tmp_path)
    folder = tmp_path / "hf_model"
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}


def test_export_null_and_checkpoint_null_write_neither(tmp_path):
    train(config("offload=cpu", "trainer.max_steps=1", "trainer.val_check_interval=1", "+trainer.limit_val_batches=1",
                 "export=null", "checkpoint=null"), tmp_path)
    assert not (tmp_path / "hf_model").exists() and not (tmp_path / "checkpoints").exists()
    assert logged(tmp_path, "val/loss")  # it trained and validated


def test_throughput_counts_only_non_padding_tokens(monkeypatch):
    clock = iter([0.0, 2.0])
    monkeypatch.setattr("lightning_slide.callbacks.time.perf_counter", lambda: next(clock, 2.0))
    logs = {}
    module = SimpleNamespace(device=torch.device("cpu"), log_dict=lambda metrics, **_: logs.update(metrics))
    monitor = ThroughputMemoryMonitor(window=2)
    monitor.on_train_start(SimpleNamespace(log_every_n_steps=50), module)
    for _ in range(2):
        mask = torch.randint(0, 2, (4, 16))
        mask[:, 0] = 1
        logs["expected"] = logs.get("expected", 0) + int(mask.sum())
        monitor.on_train_batch_end(None, module, None, {"attention_mask": mask}, 0)
    assert logs["tokens/s"] == pytest.approx(logs["expected"] / 2.0)
    assert logs["rss_peak_GiB"] > 0
