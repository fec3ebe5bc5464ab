"""The Hugging Face export: bf16 safetensors shards as save_pretrained writes them, from views of flat buffers,
with at most one shard of extra memory, refused when the disk is too small, and never half written."""

from __future__ import annotations

import copy
import filecmp
import json
import re
import weakref
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

import lightning_slide.export as export
from lightning_slide.callbacks import HFExport
from lightning_slide.export import export_dtype, save_hf_folder
from lightning_slide.models import build_model, model_config
from tests.runtime.helpers import fit, token_batches

SHARD = "200KB"  # the tiny Llama is 1.5 MB in bf16: several shards


class AliveCopies(TorchDispatchMode):
    """Bytes held by the tensors made while it is active (new storage, not views) that are still alive.

    Counts any copy, whoever makes it (the export, transformers, safetensors, a `.to()`), so it measures what
    an export costs in host memory beyond the weights it reads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: list[tuple[weakref.ref, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for tensor in pytree.tree_leaves(out):
            if torch.is_tensor(tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self._made.append((weakref.ref(tensor), tensor.untyped_storage().nbytes()))
        return out

    def alive_bytes(self) -> int:
        alive = {}
        for ref, nbytes in self._made:
            tensor = ref()
            if tensor is not None:
                alive[tensor.untyped_storage().data_ptr()] = nbytes
        return sum(alive.values())


Export = namedtuple("Export", "module folder peak_bytes writes")


def tiny_llama(**overrides: object) -> PreTrainedModel:
    """The `tiny` recipe as a published checkpoint would declare it: bf16."""
    torch.manual_seed(0)
    return LlamaForCausalLM(model_config("tiny", dtype="bfloat16", **overrides))


def on_flat_buffer(model: PreTrainedModel) -> PreTrainedModel:
    """The model with every parameter a view into one flat fp32 buffer, as the sliding strategy lays them out."""
    params = list(model.parameters())  # tied weights once
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Export:
    """Two slideformer steps, exported by HFExport in 200 KB shards while every copy made is counted."""
    folder = tmp_path_factory.mktemp("run") / "hf_model"
    copies, peaks = AliveCopies(), []
    write = export.save_file

    def measured_write(tensors, filename, metadata=None):
        peaks.append(copies.alive_bytes())
        write(tensors, filename, metadata=metadata)

    def measured_export(callback, trainer, pl_module):
        with copies:
            original(callback, trainer, pl_module)

    original = HFExport.on_train_end
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "save_file", measured_write)
        patch.setattr(HFExport, "on_train_end", measured_export)
        module = fit(tiny_llama(), token_batches(2), "slideformer", 2,
                     callbacks=[HFExport(folder, max_shard_size=SHARD)])
    return Export(module, folder, max(peaks, default=0), len(peaks))


def index_of(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (a safe_open handle does not iterate)


def test_trained_weights_are_views_of_flat_buffers(trained):
    """What the export reads: no parameter owns its storage (so safetensors would refuse it as it is)."""
    weight = trained.module.model.model.layers[0].self_attn.q_proj.weight
    assert weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()


def test_index_maps_every_tensor_to_one_of_the_numbered_shards(trained):
    index = index_of(trained.folder)
    files = sorted(p.name for p in trained.folder.glob("*.safetensors"))
    count = len(files)
    assert count >= 5
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    expected = set(trained.module.model.state_dict()) - {"lm_head.weight"}  # the tie target is not written
    assert set(index["weight_map"]) == expected
    assert set(index["weight_map"].values()) == set(files)
    for file in files:
        listed = {name for name, f in index["weight_map"].items() if f == file}
        assert listed == set(shard_tensors(trained.folder / file))


def test_shards_are_bf16_with_pt_metadata_and_the_index_totals_their_bytes(trained):
    total = 0
    for path in trained.folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        tensors = shard_tensors(path)
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        assert sum(t.numel() * 2 for t in tensors.values()) <= export.shard_bytes(SHARD)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    metadata = index_of(trained.folder)["metadata"]
    assert metadata == {"total_size": total, "total_parameters": trained.module.model.num_parameters()}


def test_config_records_the_written_dtype_and_the_class(trained):
    config = json.loads((trained.folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (trained.folder / "generation_config.json").is_file()
    assert trained.module.model.config.architectures is None  # the live config is left as it was


def test_reloaded_folder_is_the_trained_model_in_bf16(trained):
    reloaded = AutoModelForCausalLM.from_pretrained(trained.folder, local_files_only=True).eval()
    assert reloaded.dtype == torch.bfloat16
    trained_weights = trained.module.model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained_weights[name].to(torch.bfloat16)), name
    rounded = copy.deepcopy(trained.module.model).eval()  # the trained module, its weights rounded to bf16
    for p in rounded.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    tokens = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.float()(tokens).logits, rounded(tokens).logits)


def test_tied_embeddings_stay_tied_after_reload(trained):
    reloaded = AutoModelForCausalLM.from_pretrained(trained.folder, local_files_only=True)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_export_holds_at_most_one_shard_of_copies(trained):
    """Measured at every shard write: the casted copies alive then are that shard's, never the whole model."""
    total = index_of(trained.folder)["metadata"]["total_size"]
    largest = max(sum(t.numel() * t.element_size() for t in shard_tensors(p).values())
                  for p in trained.folder.glob("*.safetensors"))
    assert trained.writes == len(list(trained.folder.glob("*.safetensors")))
    assert 0 < trained.peak_bytes <= largest
    assert trained.peak_bytes * 4 < total


def test_folder_is_what_save_pretrained_writes_for_the_same_bf16_weights(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference", max_shard_size=SHARD)
    save_hf_folder(on_flat_buffer(model), tmp_path / "export", max_shard_size=SHARD)
    names = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "reference", tmp_path / "export", names, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_a_model_small_enough_for_one_shard_is_one_model_safetensors(tmp_path):
    folder = save_hf_folder(on_flat_buffer(tiny_llama()), tmp_path / "hf_model")
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_float32_option_writes_the_masters_bit_for_bit(tmp_path):
    model = on_flat_buffer(tiny_llama())
    save_hf_folder(model, tmp_path / "hf_model", dtype="float32", max_shard_size=SHARD)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", local_files_only=True)
    assert json.loads((tmp_path / "hf_model" / "config.json").read_text())["dtype"] == "float32"
    assert reloaded.dtype == torch.float32
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_an_untied_config_writes_both_embedding_and_head(tmp_path):
    model = on_flat_buffer(tiny_llama(tie_word_embeddings=False))
    save_hf_folder(model, tmp_path / "hf_model", max_shard_size=SHARD)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(index_of(tmp_path / "hf_model")["weight_map"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", local_files_only=True)
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_a_declared_tie_that_the_weights_broke_is_refused(tmp_path):
    model = tiny_llama()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match="tie_word_embeddings is set but lm_head.weight and model.embed_tokens"):
        save_hf_folder(model, tmp_path / "hf_model")
    assert list(tmp_path.iterdir()) == []


def test_a_disk_too_small_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 10**6,
                                                                                   free=10**6))
    folder = tmp_path / "hf_model"
    with pytest.raises(OSError, match=rf"(?s)to {re.escape(str(folder))}: it needs \d+ bytes.*1000000 bytes"):
        save_hf_folder(tiny_llama(), folder)
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_fails_midway_leaves_no_folder(tmp_path, monkeypatch):
    written = []

    def fails_at_the_third_shard(tensors, filename, metadata=None):
        if len(written) == 2:
            raise OSError("No space left on device")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    save_file = export.save_file
    monkeypatch.setattr(export, "save_file", fails_at_the_third_shard)
    with pytest.raises(OSError, match="No space left"):
        save_hf_folder(tiny_llama(), tmp_path / "hf_model", max_shard_size=SHARD)
    assert list(tmp_path.iterdir()) == []


def test_the_next_export_clears_what_a_killed_one_left(tmp_path):
    partial = tmp_path / ".hf_model.partial"  # a process killed while writing leaves this
    partial.mkdir()
    (partial / "model-00001-of-00009.safetensors").write_bytes(b"cut short")
    folder = save_hf_folder(tiny_llama(), tmp_path / "hf_model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert not (folder / "model-00001-of-00009.safetensors").exists()


def test_a_new_export_replaces_the_previous_folder_whole(tmp_path):
    save_hf_folder(tiny_llama(), tmp_path / "hf_model", max_shard_size=SHARD)
    save_hf_folder(tiny_llama(), tmp_path / "hf_model")
    assert sorted(p.name for p in (tmp_path / "hf_model").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]


def test_auto_dtype_is_the_checkpoint_dtype(tmp_path):
    assert export_dtype(build_model("llama3_8b", meta=True)) == torch.bfloat16  # the published recipe
    assert export_dtype(build_model("tiny")) == torch.float32  # declares none
    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "published")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32)
    assert loaded.config.dtype == torch.float32  # overwritten by the fp32 load
    assert export_dtype(loaded) == torch.bfloat16  # the folder it came from says bf16


@pytest.mark.parametrize(("setting", "match"), [(dict(dtype="int8"), "Export dtype 'int8' is not supported"),
                                                (dict(max_shard_size="5 parsecs"), "max_shard_size='5 parsecs'")])
def test_bad_export_settings_are_refused_when_the_callback_is_made(setting, match):
    with pytest.raises(ValueError, match=match):
        HFExport("hf_model", **setting)
