"""A model's weights as a Hugging Face folder, written shard by shard from views of the training state.

The folder is what `save_pretrained` writes in transformers 5: safetensors shards of at most
`max_shard_size` (default "5GB") named `model-00001-of-0000N.safetensors` with
`model.safetensors.index.json` (or one `model.safetensors`), `{"format": "pt"}` metadata in every shard,
tied weights written once under the name `from_pretrained` expects, `config.json` recording the dtype of
the written tensors, and `generation_config.json`. The weights are cast to the checkpoint's dtype
(bf16 for published Llama/Qwen/Mistral checkpoints) unless asked to keep fp32.

Why not `PreTrainedModel.save_pretrained(state_dict=..., max_shard_size=...)`: under the sliding strategy
every parameter is a view into one large flat fp32 buffer per unit. `save_pretrained` first runs
`remove_tied_weights_from_state_dict`, which sees all views of a buffer as sharing storage and `.clone()`s
every one of them before the first shard is written (a full fp32 copy: +32 GB of host RAM at 8B). It also
writes tensors in the dtype it is given, so a bf16 export would need every tensor cast up front (a lazy
mapping is materialised by that same pass over its items), it records `config.dtype` from the parameters
(fp32) rather than from what it wrote, and it writes into the target folder in place. Here the shard plan
comes from huggingface_hub's own splitter (the one `save_pretrained` uses, so the same boundaries), sized in
the export dtype, and each shard is cast, written with `safetensors.torch.save_file`, and dropped before
the next: the extra host memory is at most one shard.

The folder appears atomically: everything is written into a hidden sibling and renamed into place at the
end, so a crash never leaves a half-written folder under the final name (the next export clears it).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub import constants
from huggingface_hub.serialization import StateDictSplit, split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import save_file
from transformers import PreTrainedModel

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' and huggingface_hub's default for published checkpoints
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_METADATA = {"format": "pt"}
#: room for the safetensors headers, the index, config files and a tokenizer beside the weights
DISK_MARGIN_BYTES = 16 * 2**20


class SavesPretrained(Protocol):
    """A tokenizer or processor: anything with `save_pretrained(folder)`."""

    def save_pretrained(self, save_directory: str | os.PathLike) -> object: ...


def save_hf_folder(
    model: PreTrainedModel,
    out_dir: str | Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tokenizer: SavesPretrained | None = None,
) -> Path:
    """Write `model` (or `state_dict`, keyed like `model.state_dict()`) as a Hugging Face folder at `out_dir`.

    `dtype="auto"` is the checkpoint's own dtype (see `export_dtype`); "float32" keeps the fp32 masters.
    Refuses before writing anything when the file system cannot hold the export. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    target = export_dtype(model, dtype)
    weights = tensors_to_write(model, model.state_dict() if state_dict is None else state_dict)
    split = plan_shards(weights, target, max_shard_size)
    staging, retired = _siblings(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove(staging, retired)  # what an interrupted export left
    check_disk_space(out_dir, split.metadata["total_size"] + DISK_MARGIN_BYTES)
    try:
        staging.mkdir()
        _write_shards(weights, split, target, staging)
        _write_index(split, model.num_parameters(), staging)
        _write_configs(model, target, staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _sync_files(staging)
        _publish(staging, out_dir, retired)
    except BaseException:
        _remove(staging)
        raise
    return out_dir


def export_dtype(model: PreTrainedModel, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """The dtype to write: `dtype` itself, or for "auto" the dtype the checkpoint declares.

    The declared dtype is that of the folder the weights came from (`config.name_or_path`: training loads a
    published bf16 checkpoint into fp32 masters, which overwrites `config.dtype`), else `config.dtype`,
    else fp32.
    """
    name = _dtype_name(dtype)
    return EXPORT_DTYPES[_dtype_name(_declared_dtype(model.config)) if name == "auto" else name]


def check_settings(dtype: str | torch.dtype, max_shard_size: int | str) -> None:
    """Refuse a bad dtype or shard size up front (before a run whose export would fail at its end)."""
    _dtype_name(dtype)
    shard_bytes(max_shard_size)


def _dtype_name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name != "auto" and name not in EXPORT_DTYPES:
        raise ValueError(f"Export dtype {dtype!r} is not supported: use one of 'auto', "
                         f"{', '.join(repr(n) for n in EXPORT_DTYPES)} (e.g. export.dtype=bfloat16).")
    return name


def shard_bytes(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a string in huggingface_hub's units ("5GB", "500MB")."""
    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(str(max_shard_size))
    except ValueError as error:
        raise ValueError(f"max_shard_size={max_shard_size!r} is not a size ({error}): give bytes or a string "
                         "such as '5GB' or '500MB' (e.g. export.max_shard_size=5GB).") from error
    if size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive (e.g. export.max_shard_size=5GB).")
    return size


def _declared_dtype(config: object) -> str:
    source = Path(str(getattr(config, "name_or_path", "") or "")).expanduser() / "config.json"
    declared = None
    if source.is_file():
        recorded = json.loads(source.read_text())
        declared = recorded.get("dtype") or recorded.get("torch_dtype")
    declared = declared or getattr(config, "dtype", None)
    return "float32" if declared is None else str(declared)


def tensors_to_write(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict less what `save_pretrained` leaves out: ignored keys and the targets of tied weights.

    A tie target (e.g. `lm_head.weight` when `config.tie_word_embeddings`) is dropped when it is the very
    tensor its source is, as transformers does, so `from_pretrained` re-ties it. With an untied config both
    are written. A tie the config declares but the tensors broke is refused: reloading would lose one.
    """
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    weights = {name: tensor for name, tensor in state_dict.items() if name not in ignored}
    for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
        if target not in weights or source not in weights:
            continue
        if not _same_view(weights[target], weights[source]):
            raise ValueError(f"config.tie_word_embeddings is set but {target} and {source} are different tensors: "
                             f"from_pretrained would replace {target} with {source}. Tie them again "
                             f"(model.tie_weights()) or set config.tie_word_embeddings=False before exporting.")
        del weights[target]
    return weights


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device, a.data_ptr(), a.dtype, a.shape, a.stride()) == (b.device, b.data_ptr(), b.dtype, b.shape,
                                                                       b.stride())


def plan_shards(weights: Mapping[str, torch.Tensor], dtype: torch.dtype, max_shard_size: int | str) -> StateDictSplit:
    """huggingface_hub's split (state-dict order, a new shard before one would pass `max_shard_size`).

    Sizes are those of the written tensors, in `dtype`. Storage ids are left out on purpose: all views of
    one flat buffer share a storage, which the splitter would read as one tied tensor.
    """
    return split_state_dict_into_shards_factory(
        dict(weights), get_storage_size=lambda t: t.numel() * dtype.itemsize,
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN, max_shard_size=shard_bytes(max_shard_size))


def check_disk_space(out_dir: Path, needed: int) -> None:
    """Refuse an export the file system of `out_dir` cannot hold, before anything is written."""
    free = shutil.disk_usage(out_dir.parent).free
    if needed > free:
        raise OSError(f"Not enough disk space to export the model to {out_dir}: it needs {needed} bytes "
                      f"({needed / 1e9:.2f} GB), {free} bytes ({free / 1e9:.2f} GB) are free there. Free some "
                      "space, export elsewhere, or write a smaller dtype (export.dtype=bfloat16).")


def _write_shards(weights: Mapping[str, torch.Tensor], split: StateDictSplit, dtype: torch.dtype,
                  folder: Path) -> None:
    for filename, names in split.filename_to_tensors.items():
        shard = {name: _standalone(weights[name], dtype) for name in names}
        save_file(shard, folder / filename, metadata=SHARD_METADATA)
        del shard  # the only extra host memory: one shard of casted tensors


def _standalone(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU copy in `dtype` with its own storage (safetensors refuses views of a shared one)."""
    out = torch.empty(tensor.shape, dtype=dtype, device="cpu")
    return out.copy_(tensor.detach())


def _write_index(split: StateDictSplit, parameters: int, folder: Path) -> None:
    """`model.safetensors.index.json` as transformers writes it (only for more than one shard)."""
    if not split.is_sharded:
        return
    index = {"metadata": {"total_parameters": parameters, **split.metadata}, "weight_map": split.tensor_to_filename}
    path = folder / constants.SAFETENSORS_INDEX_FILE
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_configs(model: PreTrainedModel, dtype: torch.dtype, folder: Path) -> None:
    """config.json recording the written dtype and the class (as save_pretrained does), + generation config."""
    config = copy.deepcopy(model.config)  # the live config keeps describing the model in memory
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)


def _siblings(out_dir: Path) -> tuple[Path, Path]:
    """Hidden folders beside `out_dir`: the one being written, and the previous export while it is replaced."""
    return out_dir.with_name(f".{out_dir.name}.partial"), out_dir.with_name(f".{out_dir.name}.previous")


def _publish(staging: Path, out_dir: Path, retired: Path) -> None:
    if out_dir.exists():
        out_dir.rename(retired)
    staging.rename(out_dir)
    _sync_folder(out_dir.parent)  # the rename itself
    _remove(retired)


def _remove(*folders: Path) -> None:
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)


def _sync_files(folder: Path) -> None:
    """Flush to the disk before the rename that makes the folder visible, so it is complete after a crash."""
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _sync_folder(folder)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
