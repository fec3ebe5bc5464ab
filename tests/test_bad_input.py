"""No input trains the wrong thing quietly: weights come from the folder the user named, in either format, or
the run stops; every bad setting is named with what to write instead; a run shows what the user can act on."""

import os
import pickle
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from lightning_slide.arguments import check_arguments
from lightning_slide.materialize import meta_parameters
from lightning_slide.models import build_model
from tests.runtime.helpers import VOCAB, CausalLM, tiny_model, token_batches, trainer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = runpy.run_path(str(ROOT / "train.py"))
train = SCRIPT["train"]


def config(*overrides: str):
    """The config `python train.py <overrides>` composes."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def saved_twice(tmp_path: Path, arch: str = "qwen2-tied", shard: str | None = None) -> tuple[Path, Path]:
    """One tiny model written as save_pretrained writes it (safetensors) and in the pytorch_model.bin format
    (transformers 5 no longer writes .bin: huggingface_hub's writer makes the same files and index)."""
    model = tiny_model(arch)
    safetensors, torch_bin = tmp_path / "safetensors", tmp_path / "bin"
    model.save_pretrained(safetensors)
    model.config.save_pretrained(torch_bin)
    save_torch_state_dict(model.state_dict(), torch_bin, safe_serialization=False, max_shard_size=shard or "5GB")
    return safetensors, torch_bin


def one_step_on_meta(folder: Path) -> tuple[float, list[torch.Tensor]]:
    """First loss and the weights after one slideformer step of a meta model filled from `folder`."""
    module = CausalLM(build_model("unused", pretrained=folder, meta=True))
    fit = trainer("slideformer", 1)
    fit.fit(module, DataLoader(token_batches(1), batch_size=None))
    return float(fit.callback_metrics["loss"]), [p.detach().clone() for p in module.model.parameters()]


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_a_pytorch_model_bin_folder_fills_the_meta_model_as_its_safetensors_twin(shard, tmp_path):
    safetensors, torch_bin = saved_twice(tmp_path, shard=shard)
    index = torch_bin / "pytorch_model.bin.index.json"
    assert index.is_file() == (shard is not None) and not list(torch_bin.glob("*.safetensors"))
    loss, weights = one_step_on_meta(torch_bin)
    expected_loss, expected = one_step_on_meta(safetensors)
    assert loss == expected_loss
    assert all(torch.equal(a, b) for a, b in zip(weights, expected, strict=True))


def test_a_pytorch_model_bin_folder_loads_without_offload_as_its_safetensors_twin(tmp_path):
    safetensors, torch_bin = saved_twice(tmp_path, arch="llama", shard="20KB")
    loaded, expected = build_model("unused", pretrained=torch_bin), build_model("unused", pretrained=safetensors)
    assert loaded.training
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(a, expected.state_dict()[k]) for k, a in loaded.state_dict().items())


def test_a_pytorch_model_bin_is_unpickled_without_running_code(tmp_path):
    """weights_only=True: a .bin that would build arbitrary objects (and so could run code) is refused."""
    tiny_model("llama").config.save_pretrained(tmp_path)
    torch.save({"model.embed_tokens.weight": torch.zeros(VOCAB, 32), "hook": Path("/")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        one_step_on_meta(tmp_path)


@pytest.mark.parametrize("offload", ["cpu", "none"])
def test_a_pretrained_folder_with_only_a_config_is_refused_with_what_it_holds(offload, tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path / "model")
    expected = (r"model.pretrained='.*model' holds no model weights \(found: config.json\)\. It needs "
                r"model.safetensors or pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=expected):
        train(config(f"offload={offload}", f"model.pretrained={tmp_path / 'model'}"), tmp_path / "run")


def test_a_meta_model_naming_a_folder_without_weights_is_refused_when_the_engine_fills_it(tmp_path):
    with meta_parameters():
        model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    model.config.name_or_path = str(tmp_path)
    module = CausalLM(model)
    with pytest.raises(FileNotFoundError, match=r"name_or_path=.* holds no model weights \(found: config.json, "
                                                r"tokenizer.json\).*name_or_path = ''"):
        trainer("slideformer", 1).fit(module, DataLoader(token_batches(1), batch_size=None))


def test_a_checkpoint_index_naming_a_missing_shard_is_refused(tmp_path):
    _, torch_bin = saved_twice(tmp_path, shard="20KB")
    shard = sorted(torch_bin.glob("pytorch_model-*.bin"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shards that are not there: .*{shard.name}"):
        one_step_on_meta(torch_bin)


def test_a_meta_model_naming_no_local_folder_warns_that_it_starts_from_random_weights():
    with meta_parameters():
        model = tiny_model("llama")
    model.config.name_or_path = "meta-llama/Llama-3.2-1B"
    with pytest.warns(UserWarning, match="'meta-llama/Llama-3.2-1B' is not a local folder.*random weights"):
        trainer("slideformer", 1).fit(CausalLM(model), DataLoader(token_batches(1), batch_size=None))


def test_a_trainer_setting_of_the_wrong_type_names_the_setting_its_type_and_an_example(tmp_path):
    with pytest.raises(ValueError, match=re.escape("trainer.max_steps='abc' must be an int "
                                                   "(e.g. trainer.max_steps=100).")):
        train(config("offload=none", "trainer.max_steps=abc"), tmp_path)


def test_an_unknown_trainer_setting_is_named_with_the_closest_argument(tmp_path):
    with pytest.raises(ValueError, match=re.escape("trainer.max_stepz is not an argument of lightning.Trainer "
                                                   "(did you mean trainer.max_steps?)")):
        train(config("offload=none", "+trainer.max_stepz=5"), tmp_path)


@pytest.mark.parametrize("settings", [
    {"max_steps": 10, "precision": "bf16-mixed", "devices": "auto", "gradient_clip_val": 1, "deterministic": "warn",
     "val_check_interval": 0.5, "check_val_every_n_epoch": None, "max_time": {"hours": 1}, "fast_dev_run": True},
    {"devices": [0], "precision": 32, "limit_val_batches": 2, "log_every_n_steps": 5, "accelerator": "cpu"},
], ids=["typical", "alternatives"])
def test_values_lightning_trainer_accepts_pass_the_check(settings):
    check_arguments(SCRIPT["L"].Trainer.__init__, settings, "trainer", "lightning.Trainer")


@pytest.mark.parametrize(("setting", "words"), [
    ({"accumulate_grad_batches": True}, "trainer.accumulate_grad_batches=True must be an int (e.g. "
                                        "trainer.accumulate_grad_batches=1)"),
    ({"max_steps": 1000.0}, "trainer.max_steps=1000.0 must be an int"),
    ({"limit_val_batches": "all"}, "trainer.limit_val_batches='all' must be a number or null"),
    ({"precision": "bf17"}, "trainer.precision='bf17' must be one of 64, 32, 16, 'transformer-engine'"),
    ({"devices": [0, "1"]}, "trainer.devices=[0, '1'] must be a list of int or a string or an int"),
], ids=["bool-for-int", "float-for-int", "word-for-number", "unknown-choice", "list-item"])
def test_values_lightning_trainer_rules_out_are_named_with_the_type(setting, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        check_arguments(SCRIPT["L"].Trainer.__init__, setting, "trainer", "lightning.Trainer")


def test_jsonl_data_without_a_path_says_which_setting_to_add(tmp_path):
    with pytest.raises(ValueError, match=re.escape("data=jsonl needs data.path=/path/to/train.jsonl")):
        train(config("offload=none", "data=jsonl"), tmp_path)


def test_an_nvme_path_that_cannot_be_created_names_the_setting(tmp_path):
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "nvme"
    expected = (rf"offload.nvme_path='{path}' cannot hold the disk tier \(Not a directory: .*\)\. It must be a folder "
                "that exists or can be created, on a local disk")
    with pytest.raises(ValueError, match=expected):
        train(config("offload=nvme", f"offload.nvme_path={path}"), tmp_path / "run")


def test_an_nvme_path_below_missing_folders_is_created_and_the_run_trains(tmp_path):
    nvme = tmp_path / "missing" / "deeper" / "nvme"
    trained = train(config("offload=nvme", f"offload.nvme_path={nvme}", "offload.nvme_moments=0.5",
                           "data.seq_len=32", "data.batch_size=2",
                           "trainer.max_steps=1", "trainer.val_check_interval=1", "+trainer.limit_val_batches=1"),
                    tmp_path / "run")
    assert trained.global_step == 1
    assert nvme.is_dir() and not any(nvme.iterdir())  # the tier's private folder is gone after the run


def test_library_notices_are_quiet_and_the_runs_own_warnings_are_not():
    logger = SCRIPT["logging"].getLogger("lightning.pytorch.utilities.rank_zero")
    filters = list(logger.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SCRIPT["quiet_library_notices"]()
        for module, category in [("transformers.modeling_utils", FutureWarning), ("lightning.pytorch.x", FutureWarning),
                                 ("lightning.pytorch.trainer", UserWarning), ("lightning_slide.data", FutureWarning)]:
            warnings.warn_explicit(f"{module} {category.__name__}", category, "f.py", 1, module=module)
    logger.filters[:] = filters
    assert [str(w.message) for w in caught] == ["lightning.pytorch.trainer UserWarning",
                                                "lightning_slide.data FutureWarning"]


def test_a_run_shows_no_library_notices_and_a_sensible_epoch(tmp_path):
    """What a new user sees: `python train.py` with a step limit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "train.py", "trainer.max_steps=2", "data.seq_len=32", "trainer.val_check_interval=2",
           "+trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    shown = result.stdout + result.stderr
    assert result.returncode == 0, shown[-3000:]
    assert "Epoch 0 " in shown and "Epoch 0/-" not in shown
    for notice in ("Tip:", "litlogger", "FutureWarning", "is deprecated"):
        assert notice not in shown, notice


def test_ci_runs_the_test_command_of_the_readme():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"The tests[^\n]*:\n\n```bash\n(.+?)\n```", readme).group(1).split("#")[0].strip()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1].endswith(command), (ci[-1], command)
    assert command.startswith("bash scripts/") and (ROOT / command.split()[1]).is_file()
