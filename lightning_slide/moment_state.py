"""The Adam moments as torch optimizer state: what a checkpoint holds of them, in each `moment_precision`,
and how any of those forms is loaded into a run of any precision.

Each trained parameter's state is torch's (`step`, `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` with
amsgrad), its tensors views of the engine's flat storage, so checkpoints are written without a copy:

- "fp32": `exp_avg`, `exp_avg_sq` are fp32 tensors of the parameter's shape, exactly torch's AdamW state.
- "bf16": the same keys, bf16 tensors.
- "int8": `exp_avg`, `exp_avg_sq` are uint8 codes of the parameter's shape; `exp_avg_scale`,
  `exp_avg_sq_scale` the fp32 absmax of each block that the parameter's elements fall in; `exp_avg_qmap`,
  `exp_avg_sq_qmap` the 256 values the codes stand for (`moment_codec.Int8Codec`); `block_size` the
  elements per block and `block_offset` where in its first block the parameter starts (blocks run over a
  unit's flat buffer, so a block can span two parameters: both list its scale). Element i of exp_avg is
  `qmap[code[i]] * scale[(block_offset + i) // block_size]`; exp_avg_sq is held as its square root, so its
  element i is the square of that (and its scales are the absmax of the root).

Loading keeps exact what can be exact: the same precision resumes bit for bit (8-bit codes and scales are
copied as they are where the blocks fall as they did; bf16 and fp32 values are representable as they are).
Anything else is converted: the saved moments are decoded to fp32 and encoded in the run's precision, a
piece of a unit at a time (so fp32 state quantises into an 8-bit run, 8-bit state dequantises into an fp32
run). The load reads the checkpoint's tensors where they are (mapped from the file), never through torch's
`Optimizer.load_state_dict`, which would first cast every moment to the parameter's dtype (a state it has
cast so, as under Fabric, loads exactly all the same). Plain torch and Lightning's other strategies read fp32
moments only: a compact checkpoint reaches them through a slideformer run with moment_precision="fp32".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_slide.moment_codec import BLOCK, SCRATCH_ELEMS, MomentCodec, Packed
from lightning_slide.storage import UnitStorage

KEYS = ("exp_avg", "exp_avg_sq")
EXTRA_KEYS = tuple(f"{key}_{part}" for key in KEYS for part in ("scale", "qmap")) + ("block_size", "block_offset")


def state_entries(s: UnitStorage, p: nn.Parameter, codecs: tuple[MomentCodec, MomentCodec]) -> dict[str, Any]:
    """The moments of trained parameter `p` of unit `s`, as its optimizer state shows them (views)."""
    start = s.offsets[id(p)]
    entries: dict[str, Any] = {}
    for key, codec, moment in zip(KEYS, codecs, (s.exp_avg, s.exp_avg_sq)):
        entries[key] = s.view(moment.values, p)
        if moment.scales is not None:
            entries[f"{key}_scale"] = moment.scales[start // BLOCK : -(-(start + p.numel()) // BLOCK)]
            entries[f"{key}_qmap"] = codec.qmap
    if s.exp_avg.scales is not None:
        entries.update(block_size=BLOCK, block_offset=start % BLOCK)
    return entries


def without_moments(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer state_dict with the moments taken out (what torch's own load_state_dict gets)."""
    drop = set(KEYS) | set(EXTRA_KEYS)
    state = {i: {k: v for k, v in entry.items() if k not in drop} for i, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def saved_entries(state_dict: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[int, Mapping[str, Any]]:
    """id(parameter) -> its saved state, matched as torch matches them (saved groups' ids in order)."""
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {id(p): state_dict["state"][i] for i, p in zip(saved, params) if i in state_dict["state"]}


def load_unit(s: UnitStorage, entries: Mapping[int, Mapping[str, Any]],
              codecs: tuple[MomentCodec, MomentCodec]) -> None:
    """Write the saved moments of unit `s`'s trained parameters (`entries`, by parameter id; missing: zeros),
    converting a piece of at most SCRATCH_ELEMS at a time where they are not copied as they are."""
    scratch = torch.empty(min(SCRATCH_ELEMS, s.trainable_numel))
    placed = [(s.offsets[id(p)], p.numel(), entries.get(id(p))) for p in s.params
              if s.offsets[id(p)] < s.trainable_numel]
    for key, codec, moment in zip(KEYS, codecs, (s.exp_avg, s.exp_avg_sq)):
        if moment.scales is not None and all(e is not None and _same_blocks(e, key, at, codec) for at, _, e in placed):
            for at, n, e in placed:
                _copy_codes(moment, at, n, e, key)
            continue
        for a in range(0, s.trainable_numel, SCRATCH_ELEMS):
            b = min(a + SCRATCH_ELEMS, s.trainable_numel)
            x = scratch[: b - a].zero_()
            for at, n, e in placed:
                lo, hi = max(a, at), min(b, at + n)
                if e is not None and lo < hi:
                    x[lo - a : hi - a] = saved_values(e, key, lo - at, hi - at)
            codec.encode(x, moment[a:b], 0, s.index, a)


def saved_values(entry: Mapping[str, Any], key: str, i: int, j: int) -> torch.Tensor:
    """Elements [i, j) of a saved moment, as fp32, whichever form it was saved in."""
    values = entry[key].reshape(-1)[i:j]
    if f"{key}_scale" not in entry:
        return values.float()
    blocks = (torch.arange(i, j) + int(entry["block_offset"])) // int(entry["block_size"])
    x = entry[f"{key}_qmap"].float()[values.long()] * entry[f"{key}_scale"].float()[blocks]
    return x.square_() if key == "exp_avg_sq" else x


def _same_blocks(entry: Mapping[str, Any], key: str, at: int, codec: MomentCodec) -> bool:
    """The saved 8-bit moment's blocks fall where the run's do, with the run's map: its codes copy as they are."""
    return (f"{key}_scale" in entry and int(entry["block_size"]) == BLOCK and int(entry["block_offset"]) == at % BLOCK
            and torch.equal(entry[f"{key}_qmap"].float(), codec.qmap))


def _copy_codes(moment: Packed, at: int, n: int, entry: Mapping[str, Any], key: str) -> None:
    moment.values[at : at + n].copy_(entry[key].reshape(-1))
    scales = entry[f"{key}_scale"]
    moment.scales[at // BLOCK : at // BLOCK + scales.numel()].copy_(scales)
