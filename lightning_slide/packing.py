"""Packing: short examples share rows of up to `seq_len` tokens, and each is still trained as if it were alone.

A packed row holds whole examples one after another (`pack`: best-fit decreasing), with `position_ids` that
restart at 0 for each and no `attention_mask`. From exactly that, transformers
(`masking_utils.find_packed_sequence_indices`, used by `create_causal_mask` when a batch has position ids and
no attention mask) builds a causal mask per example: with sdpa and eager attention a block-diagonal 4-D mask
per row, with flex attention a block mask, so no token attends across an example boundary; rotary embeddings
turn each example from position 0. The first label of every example is -100: the token before it (the previous
example's last) would otherwise learn to predict it. Each token then gets the loss it gets alone.

A batch pads its rows to the longest: pad-token ids, label -100 and position 0 for every pad token (each a
sequence of its own). A real token at position 0 is followed by position 1, since every example the data module
keeps has at least two tokens: that is how `non_padding_tokens` tells the padding apart.

Flash attention (flash_attention_2/3/4) ignores the position ids unless the batch has one row (it then reads
the examples' bounds from them, as cu_seqlens); a batch of several packed rows is refused with it, as with
any attention transformers builds no mask for.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_slide.chat import IGNORE_INDEX

#: Attention implementations that build a per-example mask from the position ids of a packed batch.
MASKED_BY_POSITIONS = ("sdpa", "eager", "flex_attention")
#: Those that read the examples' bounds from the position ids only in a batch of one row.
ONE_ROW_ONLY = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of the examples of `lengths` grouped into rows of at most `capacity` tokens, by best-fit decreasing:
    longest first, each into the row it leaves the least room in, a new row where none has room. Ties go by index,
    so the rows are a function of the lengths alone."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row) of the rows with room, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            rows.append([i])
            left, row = capacity - lengths[i], len(rows) - 1
        else:
            left, row = room.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, row))
    return rows


def packed_row(examples: Sequence[dict[str, list[int]]]) -> dict[str, list[int]]:
    """One row: the examples' tokens, their labels with each first one -100, their positions from 0 each."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for example in examples:
        ids += example["input_ids"]
        labels += [IGNORE_INDEX, *example["labels"][1:]]
        positions += range(len(example["input_ids"]))
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pad_rows(rows: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of packed rows, each padded to the longest (pad-token ids, label -100, position 0)."""
    longest = max(len(row["input_ids"]) for row in rows)
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "position_ids": 0}
    return {key: torch.tensor([row[key] + [value] * (longest - len(row[key])) for row in rows])
            for key, value in fill.items()}


class PackedRows(Dataset):
    """`examples` packed into rows of at most `seq_len` tokens; a row is assembled when it is read, so each
    example is held once."""

    def __init__(self, examples: Sequence[dict[str, list[int]]], seq_len: int) -> None:
        self.examples = examples
        lengths = [len(e["input_ids"]) for e in examples]
        self.rows = pack(lengths, seq_len)
        self.row_lengths = [sum(lengths[i] for i in row) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return packed_row([self.examples[i] for i in self.rows[index]])


def batch_padding(lengths: Sequence[int], batch_size: int) -> float:
    """The fraction of padding when each run of `batch_size` consecutive examples is padded to its longest."""
    batches = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    return 1 - sum(lengths) / sum(max(b) * len(b) for b in batches)


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    return "position_ids" in batch


def model_inputs(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, Any]:
    """What the model is called with: token ids and the padding mask, or, for packed rows, token ids and the
    position ids (no mask: transformers then builds one per example); never a KV cache (training needs none, and
    with one transformers does not look for packed rows: a model whose config says use_cache=True would let the
    examples of a row attend to each other). Packed rows under an attention that would do the same are refused."""
    if not is_packed(batch):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    rows = batch["input_ids"].shape[0]
    if not (attention in MASKED_BY_POSITIONS or (attention in ONE_ROW_ONLY and rows == 1)):
        one_row = " (it keeps examples apart in a batch of one row only: data.batch_size=1)" if (
            attention in ONE_ROW_ONLY) else ""
        raise ValueError(f"Packed rows need an attention that masks each example from the others: "
                         f"{', '.join(MASKED_BY_POSITIONS)}; this model uses {attention!r}{one_row}. Load the model "
                         "with attn_implementation='sdpa', or set data.packing=false.")
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def non_padding_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's real tokens, counted where the batch lies (no synchronisation): the padding mask's ones, or in
    packed rows every token but the pad tokens (position 0 and not followed by position 1)."""
    if not is_packed(batch):
        return batch["attention_mask"].sum()
    positions = batch["position_ids"]
    following = F.pad(positions[:, 1:], (0, 1))
    return positions.numel() - ((positions == 0) & (following != 1)).sum()
