"""Big models are never held twice: parameters are created on the meta device and get their values unit by
unit, straight into the flat host storage.

`meta_parameters()` builds a model whose parameters are placeholders (its buffers, e.g. rotary tables, are
real); the engine then fills each unit's slice of the fp32 master from the weights of the local checkpoint
folder in `config.name_or_path` (safetensors or `pytorch_model.bin`, one file or shards with an index), or,
when the model names no local folder, with the model's own initialiser. A folder without weights is an error:
training random weights in place of the intended checkpoint is the one mistake a fine-tuning run must not hide.
"""

from __future__ import annotations

import json
import logging
import warnings
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

#: The weight layouts `save_pretrained` writes (and older versions wrote), in the order transformers prefers
#: them: (single file, index of shards).
WEIGHT_LAYOUTS = (("model.safetensors", "model.safetensors.index.json"),
                  ("pytorch_model.bin", "pytorch_model.bin.index.json"))


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get meta-device parameters (no memory, no init cost); buffers stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_weights(folder: Path) -> bool:
    """Whether `folder` holds weights in one of the layouts `save_pretrained` writes."""
    return any((folder / name).is_file() for layout in WEIGHT_LAYOUTS for name in layout)


def missing_weights(folder: Path, setting: str, remedy: str) -> FileNotFoundError:
    """The error for a model folder without weights: what is there, what is needed, and what to change."""
    found = sorted(p.name for p in folder.iterdir())
    listing = ", ".join(found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "") or "nothing"
    return FileNotFoundError(
        f"{setting}={str(folder)!r} holds no model weights (found: {listing}). It needs model.safetensors or "
        "pytorch_model.bin, or their shards with model.safetensors.index.json or pytorch_model.bin.index.json, "
        f"as save_pretrained writes them. {remedy}")


class CheckpointReader(ABC):
    """Tensors by parameter name from a local folder's weights: one file, or shards listed by an index.

    Subclasses open one file format; `open` picks the one the folder holds, as `from_pretrained` would.
    """

    def __init__(self, folder: Path, file_of: dict[str, Path]) -> None:
        self.folder, self.file_of = folder, file_of
        self._files: dict[Path, object] = {}
        missing = sorted({str(f) for f in file_of.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(f"The checkpoint index in {folder} lists shards that are not there: "
                                    f"{', '.join(missing)}. Copy the whole folder that save_pretrained wrote.")

    @staticmethod
    def open(folder: Path) -> CheckpointReader:
        """The reader for the weights in `folder` (safetensors first); FileNotFoundError without any."""
        for reader, (single, index) in zip((SafetensorsReader, TorchBinReader), WEIGHT_LAYOUTS):
            if (folder / index).is_file():
                weight_map = json.loads((folder / index).read_text())["weight_map"]
                return reader(folder, {name: folder / file for name, file in weight_map.items()})
            if (folder / single).is_file():
                return reader(folder, {name: folder / single for name in reader.names_in(folder / single)})
        raise missing_weights(folder, "model.config.name_or_path", "Put the weights there, or set "
                              "model.config.name_or_path = '' to start from the model's initialiser.")

    @classmethod
    def of(cls, model: nn.Module) -> CheckpointReader | None:
        """The reader for the local folder the model names; None (random init) when it names no local folder."""
        name = str(getattr(model.config, "name_or_path", "") or "")
        folder = Path(name).expanduser()
        if name and folder.is_dir():
            return cls.open(folder)
        if name:
            warnings.warn(f"model.config.name_or_path={name!r} is not a local folder, so the model's meta "
                          "placeholders get its initialiser (random weights). To fine-tune the weights of that "
                          "checkpoint, download it (e.g. huggingface_hub.snapshot_download) and set "
                          "model.config.name_or_path to the folder.", stacklevel=2)
        return None

    @staticmethod
    @abstractmethod
    def names_in(path: Path) -> list[str]:
        """The tensor names in one file of this format."""

    @abstractmethod
    def _load(self, path: Path) -> object:
        """An open file of this format, from which `_tensor` reads; opened once per file."""

    @abstractmethod
    def _tensor(self, handle: object, name: str) -> torch.Tensor:
        """One tensor of an open file."""

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        if name not in self.file_of:
            raise KeyError(f"The checkpoint in {self.folder} has no tensor {name!r} for a parameter of the model; "
                           "was it saved from the same architecture?")
        path = self.file_of[name]
        if path not in self._files:
            self._files[path] = self._load(path)
        tensor = self._tensor(self._files[path], name)
        if tensor.shape != dst.shape:
            raise ValueError(f"{name} in {path} has shape {tuple(tensor.shape)}, the model expects {tuple(dst.shape)}.")
        dst.copy_(tensor)


class SafetensorsReader(CheckpointReader):
    """`model.safetensors` files, memory-mapped by safetensors itself."""

    @staticmethod
    def names_in(path: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return list(f.keys())

    def _load(self, path: Path) -> object:
        from safetensors import safe_open

        return safe_open(path, framework="pt").__enter__()

    def _tensor(self, handle: object, name: str) -> torch.Tensor:
        return handle.get_tensor(name)


class TorchBinReader(CheckpointReader):
    """`pytorch_model.bin` files (torch.save pickles), loaded the safe way: `weights_only=True` unpickles
    tensors and plain containers only, never code; zip-format files (torch >= 1.6) are memory-mapped, so a
    shard costs page cache, not a copy."""

    @staticmethod
    def names_in(path: Path) -> list[str]:
        return list(TorchBinReader._state_dict(path))

    def _load(self, path: Path) -> object:
        return self._state_dict(path)

    def _tensor(self, handle: object, name: str) -> torch.Tensor:
        return handle[name]

    @staticmethod
    def _state_dict(path: Path) -> dict[str, torch.Tensor]:
        mmap = zipfile.is_zipfile(path)  # the legacy (pre-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def materialize_(model: nn.Module, units: list[list[nn.Module]], placeholders: set[int],
                 device: torch.device) -> None:
    """Give every parameter in `placeholders` (ids of ex-meta parameters, now master views) its value.

    Unit by unit, so a checkpoint's shards are read once each and nothing is staged beside the master.
    Random init runs on `device` one module at a time (CPU `normal_` would take minutes for a 14B model).
    """
    if not placeholders:
        return
    reader = CheckpointReader.of(model)
    source = f"the checkpoint in {reader.folder}" if reader else "the model's initialiser (no local checkpoint folder)"
    log.info("slideformer: filling %d parameters from %s, unit by unit", len(placeholders), source)
    names = {id(p): name for name, p in model.named_parameters()}
    with torch.no_grad():
        for modules in units:
            for module in modules:
                for sub in module.modules():
                    _fill(model, sub, reader, names, placeholders, device)


def _fill(model: nn.Module, module: nn.Module, reader: CheckpointReader | None, names: dict[int, str],
          placeholders: set[int], device: torch.device) -> None:
    params = {name: p for name, p in module._parameters.items() if p is not None and id(p) in placeholders}
    if not params:
        return
    if reader is not None:
        for p in params.values():
            reader.read_into(names[id(p)], p.data)
    else:
        _initialise(model, module, params, device)
    placeholders.difference_update(id(p) for p in params.values())


def _initialise(model: nn.Module, module: nn.Module, params: dict[str, nn.Parameter], device: torch.device) -> None:
    """The model's own `_init_weights` on stand-ins on `device`, copied into the master views."""
    stand_ins = {name: nn.Parameter(torch.empty_like(p, device=device)) for name, p in params.items()}
    module._parameters.update(stand_ins)
    try:
        model._init_weights(module)
        for name, p in params.items():
            p.data.copy_(stand_ins[name].data)
    finally:
        module._parameters.update(params)
