"""`ops.patch(model)`: put the kernels into a Hugging Face Llama / Qwen2 / Qwen3 / Mistral model.

What changes, and why this way:
- RMSNorm and MLP modules change class, per instance, to a subclass whose `forward` calls the
  kernel with the module's own `self.weight` (so a runtime that swaps a module's parameters in
  only for the duration of that module's call still works). `isinstance` checks keep passing.
- MLPs whose projections are plain bias-free `nn.Linear`s also run over sequence tiles for long
  micro-batches (`tiled_mlp`, `mlp_tile_tokens`); a PEFT adapter in a projection leaves its MLP untiled.
- Attention modules change class the same way: with `grouped_attention` on, where a call records a graph
  over enough tokens that FlashAttention's backward buffers would be large
  (`grouped_attention.kv_heads_per_group`), their SDPA call runs a group of key/value heads at a time
  (`grouped_attention`); shorter calls run as they did. It saves GiBs at long sequences but runs ATen's
  flash kernels, where SDPA may pick faster ones (cuDNN's on an H200), so a runtime that plans memory
  turns it on only where a micro-batch needs it (`PatchHandle.group_attention`).
- `apply_rotary_pos_emb` is replaced in the model's modeling module, where HF's attention looks
  it up. That name is process-wide: it is reference-counted across patched models and restored
  when the last one is unpatched. Models of the same family that were not patched see the kernel
  too; it computes the same thing (and falls back to HF's math wherever it does not apply).
- `lm_head` changes class to `LinearCrossEntropyHead` (same `weight` Parameter: tied embeddings
  stay tied) and the CausalLM's `forward` (an instance attribute) calls
  `self.lm_head(hidden, labels=...)`, so the fused loss runs inside the head's own call and the
  full logits never exist. With labels, the output has `loss` and `logits=None`.
Everything is undone by `handle.unpatch()` or `ops.unpatch(model)`.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from .cross_entropy import CHUNK_MIB, IGNORE_INDEX, LinearCrossEntropyHead
from .glu import swiglu
from .grouped_attention import GroupedSDPA, kv_heads_per_group
from .norm import rms_norm
from .rotary import apply_rotary_pos_emb
from .tiled_mlp import TileSetting, check_tile_setting, compute_itemsize, tile_for, tiled_mlp

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
_HANDLE_ATTR = "_ops_patch_handle"
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


class _KernelRMSNorm:
    """Forward of a patched HF RMSNorm (Llama-style: weight * normalised, eps `variance_epsilon`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return rms_norm(hidden_states, self.weight, eps)


class _KernelSwiGLUMLP:
    """Forward of a patched HF MLP: `down(silu(gate(x)) * up(x))` with the fused elementwise core."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class _TiledMLP:
    """Forward of an HF SwiGLU MLP over sequence tiles where `tile_for` says so (`self.mlp_tile_tokens`), else
    the forward it had."""

    prefix = "Tiled"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        tile = tile_for(self.mlp_tile_tokens, tokens, self.gate_proj.out_features, compute_itemsize(x))
        if tile is None:
            return super().forward(x)
        return tiled_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, tile)


class _GroupedHeadsAttention:
    """Forward of an HF attention module whose SDPA call runs over groups of key/value heads where
    `kv_heads_per_group` groups a call of this many tokens (and `self.grouped_attention` is on), else the
    forward it had."""

    prefix = "Grouped"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        group = None
        if self.grouped_attention and torch.is_grad_enabled():
            heads = self.config.num_attention_heads
            group = kv_heads_per_group(hidden_states.numel() // hidden_states.shape[-1], heads,
                                       heads // self.num_key_value_groups, self.head_dim,
                                       compute_itemsize(hidden_states))
        if group is None:
            return super().forward(hidden_states, *args, **kwargs)
        with GroupedSDPA(group):
            return super().forward(hidden_states, *args, **kwargs)


_subclasses: dict[tuple[type, type], type] = {}


def _subclass(mixin: type, cls: type) -> type:
    """`mixin` over `cls`, made once and registered in this module so pickling finds it."""
    key = (mixin, cls)
    if key not in _subclasses:
        name = f"{getattr(mixin, 'prefix', 'Kernel')}{cls.__name__}"
        while name in globals():
            name += "_"
        sub = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = sub
        _subclasses[key] = sub
    return _subclasses[key]


def _swap_class(module: nn.Module, new_cls: type) -> Callable[[], None]:
    old_cls = type(module)
    module.__class__ = new_cls
    return lambda: setattr(module, "__class__", old_cls)


def _family(module: nn.Module) -> str | None:
    parts = type(module).__module__.split(".")
    if len(parts) >= 3 and parts[:2] == ["transformers", "models"] and parts[2] in SUPPORTED:
        return parts[2]
    return None


def _is_rms_norm(m: nn.Module) -> bool:
    return (_family(m) is not None and type(m).__name__.endswith("RMSNorm")
            and isinstance(getattr(m, "weight", None), nn.Parameter)
            and (hasattr(m, "variance_epsilon") or hasattr(m, "eps")))


def _is_swiglu_mlp(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    return (_family(m) is not None and type(m).__name__.endswith("MLP")
            and all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def _is_tileable(m: nn.Module) -> bool:
    """A SwiGLU MLP of plain bias-free projections: what `tiled_mlp` computes from their weights alone."""
    return _is_swiglu_mlp(m) and all(type(getattr(m, n)) is nn.Linear and getattr(m, n).bias is None
                                     for n in ("gate_proj", "up_proj", "down_proj"))


def _is_attention(m: nn.Module) -> bool:
    """An HF attention module of a supported family: heads from its config, `num_key_value_groups` and `head_dim`."""
    return (_family(m) is not None and type(m).__name__.endswith("Attention")
            and all(hasattr(m, n) for n in ("config", "num_key_value_groups", "head_dim")))


def _group_attention(m: nn.Module, on: bool) -> list[Callable[[], None]]:
    undo = _swap_class(m, _subclass(_GroupedHeadsAttention, type(m)))
    m.grouped_attention = on
    return [undo, lambda: m.__dict__.pop("grouped_attention", None)]


def _tile_mlp(m: nn.Module, setting: TileSetting) -> list[Callable[[], None]]:
    undo = _swap_class(m, _subclass(_TiledMLP, type(m)))
    m.mlp_tile_tokens = setting
    return [undo, lambda: m.__dict__.pop("mlp_tile_tokens", None)]


# modeling module -> [HF's apply_rotary_pos_emb, number of live patches]
_rope_patches: dict[types.ModuleType, list] = {}


def _patch_rope(modeling: types.ModuleType) -> Callable[[], None]:
    entry = _rope_patches.get(modeling)
    if entry is None:
        entry = _rope_patches[modeling] = [modeling.apply_rotary_pos_emb, 0]
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    entry[1] += 1

    def undo() -> None:
        entry[1] -= 1
        if entry[1] == 0:
            modeling.apply_rotary_pos_emb = entry[0]
            del _rope_patches[modeling]
    return undo


def _output_with_loss(outputs, loss: torch.Tensor):
    """A `CausalLMOutputWithPast` with the loss, no logits, and the body's other outputs.

    Built from the dataclass fields so it works whether this transformers names the cache
    `cache` (5.2x) or `past_key_values` (earlier 5.x).
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    rest = {f.name: getattr(outputs, f.name, None) for f in dataclasses.fields(CausalLMOutputWithPast)
            if f.name not in ("loss", "logits")}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def _fused_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                             inputs_embeds=None, labels=None, logits_to_keep=0, **kwargs):
    """HF's CausalLM forward, but with labels the loss is computed inside `self.lm_head`'s call."""
    unfused = self._ops_unfused_forward
    if (labels is None and kwargs.get("shift_labels") is None) or not (
            isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return unfused(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       inputs_embeds=inputs_embeds, labels=labels, logits_to_keep=logits_to_keep,
                       **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    loss_kwargs = {k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs}
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, **kwargs)
    loss = self.lm_head(outputs[0], labels=labels, shift_labels=loss_kwargs.get("shift_labels"),
                        ignore_index=loss_kwargs.get("ignore_index", IGNORE_INDEX),
                        num_items_in_batch=loss_kwargs.get("num_items_in_batch"))
    out = _output_with_loss(outputs, loss)
    return out.to_tuple() if return_dict is False else out


def _patch_head(model: nn.Module, softcap, z_loss_weight: float, chunk_mib: float) -> list[Callable[[], None]]:
    head = model.lm_head
    undo = [_swap_class(head, LinearCrossEntropyHead)]
    head.softcap, head.z_loss_weight, head.chunk_mib = softcap, z_loss_weight, chunk_mib

    def drop_head_options() -> None:
        for name in ("softcap", "z_loss_weight", "chunk_mib"):
            head.__dict__.pop(name, None)
    undo.append(drop_head_options)

    had_instance_forward = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    model._ops_unfused_forward = model.forward  # an instance wrapper, if any, or the class forward
    model.forward = types.MethodType(_fused_causal_lm_forward, model)

    def restore_forward() -> None:
        del model._ops_unfused_forward
        if had_instance_forward:
            model.forward = previous
        else:
            del model.forward
    undo.append(restore_forward)
    return undo


@dataclasses.dataclass
class PatchHandle:
    """What `patch` changed; `unpatch()` (or leaving a `with` block) puts it all back."""

    model: nn.Module
    counts: dict[str, int]
    _undo: list[Callable[[], None]]
    tiled: list[nn.Module]  # the MLPs that run over sequence tiles where their setting says so
    attention: list[nn.Module]  # the attention modules that may run over groups of heads

    def tile_mlps(self, setting: TileSetting) -> None:
        """Set every tiled MLP's `mlp_tile_tokens` (a runtime that plans memory decides "auto" per micro-batch)."""
        check_tile_setting(setting)
        for m in self.tiled:
            m.mlp_tile_tokens = setting

    def group_attention(self, on: bool) -> None:
        """Let every patched attention module run long calls over groups of heads (True) or never (False)."""
        for m in self.attention:
            m.grouped_attention = on

    def unpatch(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.model.__dict__.pop(_HANDLE_ATTR, None)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def _patch_modules(model: nn.Module, counts: dict[str, int], rms_norm: bool, swiglu: bool,
                   mlp_tile_tokens: TileSetting, tiled: list[nn.Module], grouped_attention: bool,
                   attention: list[nn.Module]) -> list[Callable[[], None]]:
    """Swap the RMSNorm, MLP and attention modules' classes; counts what changed and collects the tiled MLPs and
    the attention modules."""
    undo: list[Callable[[], None]] = []
    for m in model.modules():
        if _is_attention(m):
            undo.extend(_group_attention(m, grouped_attention))
            attention.append(m)
            counts["grouped_attention"] += 1
            continue
        if rms_norm and _is_rms_norm(m):
            undo.append(_swap_class(m, _subclass(_KernelRMSNorm, type(m))))
            counts["rms_norm"] += 1
            continue
        tileable = mlp_tile_tokens is not None and _is_tileable(m)  # before a swap: it reads the HF class
        if swiglu and _is_swiglu_mlp(m):
            undo.append(_swap_class(m, _subclass(_KernelSwiGLUMLP, type(m))))
            counts["swiglu"] += 1
        if tileable:
            undo.extend(_tile_mlp(m, mlp_tile_tokens))
            tiled.append(m)
            counts["tiled_mlp"] += 1
    return undo


def supports(model: nn.Module) -> bool:
    """Whether `model` holds modules of a family `patch` knows."""
    return any(_family(m) for m in model.modules())


def patch(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
          cross_entropy: bool = True, softcap: float | None = None, z_loss_weight: float = 0.0,
          chunk_mib: float = CHUNK_MIB, mlp_tile_tokens: TileSetting = "auto",
          grouped_attention: bool = False) -> PatchHandle:
    """Swap the kernels into `model` (before any runtime wraps its modules); returns the handle.

    `softcap` and `z_loss_weight` apply to the fused loss (off by default: Llama, Qwen and
    Mistral train without them). `mlp_tile_tokens` is when MLPs run over sequence tiles
    (`tiled_mlp.tile_for`: "auto", tokens per tile, or None for never). `grouped_attention` lets long
    attention calls run over groups of heads (`grouped_attention.kv_heads_per_group`; the handle's
    `group_attention` switches it): off by default, as it trades speed for memory. Raises for a model outside
    the supported families.
    """
    if not supports(model):
        raise ValueError(f"ops.patch supports Hugging Face {', '.join(SUPPORTED)} models; "
                         f"got {type(model).__name__} from {type(model).__module__}")
    if _HANDLE_ATTR in model.__dict__:
        raise RuntimeError("model is already patched; call ops.unpatch(model) first")
    check_tile_setting(mlp_tile_tokens)
    counts = {"rms_norm": 0, "swiglu": 0, "tiled_mlp": 0, "grouped_attention": 0, "rope": 0, "cross_entropy": 0}
    tiled: list[nn.Module] = []
    attention: list[nn.Module] = []
    undo = _patch_modules(model, counts, rms_norm, swiglu, mlp_tile_tokens, tiled, grouped_attention, attention)
    if rope:
        modelings = {sys.modules[type(m).__module__] for m in model.modules() if _family(m)}
        for modeling in modelings:
            if hasattr(modeling, "apply_rotary_pos_emb"):
                undo.append(_patch_rope(modeling))
                counts["rope"] += 1
    if cross_entropy and type(getattr(model, "lm_head", None)) is nn.Linear and hasattr(model, "model"):
        undo.extend(_patch_head(model, softcap, z_loss_weight, chunk_mib))
        counts["cross_entropy"] = 1
    handle = PatchHandle(model, counts, undo, tiled, attention)
    model.__dict__[_HANDLE_ATTR] = handle
    return handle


def unpatch(model: nn.Module) -> None:
    """Undo `patch(model)`; a model that is not patched is left alone."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    if handle is not None:
        handle.unpatch()
