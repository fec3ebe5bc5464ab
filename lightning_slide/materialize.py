"""Big models are never held twice: parameters are created on the meta device and get their values unit by
unit, straight into the flat host storage.

`meta_parameters()` builds a model whose parameters are placeholders (its buffers, e.g. rotary tables, are
real); the engine then fills each unit's slice of the fp32 master from the safetensors shards of the local
checkpoint folder in `config.name_or_path`, or, without one, with the model's own initialiser.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)


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


class CheckpointReader:
    """Tensors by parameter name from a local folder's safetensors (one file, or shards with an index)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder, self._open = folder, safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = folder / "model.safetensors"
            with safe_open(single, framework="pt") as f:
                self.file_of = {k: single for k in f.keys()}
        self._handles: dict[Path, object] = {}

    @classmethod
    def of(cls, model: nn.Module) -> "CheckpointReader | None":
        folder = Path(str(getattr(model.config, "name_or_path", "") or "")).expanduser()
        has_weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
        return cls(folder) if has_weights else None

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        if name not in self.file_of:
            raise KeyError(f"The checkpoint in {self.folder} has no tensor {name!r} for a parameter of the model; "
                           "was it saved from the same architecture?")
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = self._open(path, framework="pt").__enter__()
        tensor = self._handles[path].get_tensor(name)
        if tensor.shape != dst.shape:
            raise ValueError(f"{name} in {path} has shape {tuple(tensor.shape)}, the model expects {tuple(dst.shape)}.")
        dst.copy_(tensor)


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
