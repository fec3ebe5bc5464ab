"""Training data: a built-in corpus that needs no download, and local records of text, prompt/response or chat.

Records come from a JSONL file or a local Hugging Face dataset (`sources.py`). Every example is a dict of token
lists with `labels` (-100 where no loss is taken: prompts and padding), so the module computes one kind of loss
whatever the source. Each record's keys decide its format, so one source may mix them. Examples of records are
packed into full rows by default (`packing.py`); the built-in corpus is cut into full windows already.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import DataLoader, Dataset, Sampler, random_split
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from lightning_slide.chat import IGNORE_INDEX, encode_chat
from lightning_slide.packing import PackedRows, batch_padding, pad_rows
from lightning_slide.sources import read_records

#: Standard-library modules whose source is the built-in corpus: present in every Python install, so the
#: demo trains offline. Python code is regular enough that a tiny model's loss falls within a minute.
BUILTIN_MODULES = (
    "argparse", "dataclasses", "textwrap", "json.decoder", "json.encoder", "functools", "string",
    "collections", "enum", "pathlib", "typing", "logging", "csv", "heapq", "bisect", "shlex",
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code (256 byte tokens + pad + end-of-text): no file, no download."""
    specials = ["<|pad|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=specials[0], eos_token=specials[1], bos_token=specials[1]
    )


def load_tokenizer(pretrained: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The pretrained folder's own tokenizer, or the built-in byte tokenizer; always with a pad token."""
    if pretrained is None:
        return byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(Path(pretrained).expanduser(), local_files_only=True)
    if tokenizer.pad_token is None:  # e.g. Llama 3 ships none; padded positions are masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def builtin_examples(tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[dict[str, list[int]]]:
    """The standard-library corpus, packed into full `seq_len` windows (no padding, loss on every token)."""
    sources = (inspect.getsource(importlib.import_module(name)) for name in BUILTIN_MODULES)
    ids: list[int] = []
    for source in sources:
        ids += tokenizer(source, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return [{"input_ids": w, "attention_mask": [1] * seq_len, "labels": w} for w in windows]


def encode_record(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> dict[str, list[int]]:
    """Tokens of one record, cut to `seq_len`, with loss on the text, the response or the assistant turns only."""
    if "messages" in record and not isinstance(record.get("text"), str):
        return encode_chat(record["messages"], tokenizer, seq_len)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if isinstance(record.get("text"), str):
        prompt, target = [], tokenizer(record["text"])["input_ids"] + eos
    else:
        prompt = tokenizer(record["prompt"])["input_ids"]
        target = tokenizer(record["response"], add_special_tokens=False)["input_ids"] + eos
    input_ids = (prompt + target)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt) + target)[:seq_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def local_examples(path: str | Path, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                   columns: Mapping[str, str | None] | None = None) -> list[dict[str, list[int]]]:
    """Encoded records of `data.path`, skipping (with a warning) those whose response or assistant turns lie
    past `seq_len` (every example kept has a trained token after its first, so at least two tokens)."""
    encoded = [encode_record(r, tokenizer, seq_len) for r in read_records(path, columns)]
    examples = [e for e in encoded if any(label != IGNORE_INDEX for label in e["labels"][1:])]
    if len(examples) < len(encoded):
        warnings.warn(f"{len(encoded) - len(examples)} record(s) of {path} have no response or assistant token "
                      f"within data.seq_len={seq_len} and were skipped; raise data.seq_len to keep them.", stacklevel=2)
    return examples


class TextDataModule(L.LightningDataModule):
    """Batches for causal-LM fine-tuning: the built-in corpus (`path=None`) or local records (`sources.py`).

    A seeded random `val_fraction` of the examples (at least one) is held out for validation. With `packing`
    (the default) the examples of records are packed into rows of up to `seq_len` tokens, training and validation
    apart; a batch then holds `input_ids`, `labels` and `position_ids` (no `attention_mask`: see `packing.py`),
    padded to its longest row. Without it, or for the built-in corpus, a batch holds `input_ids`, `attention_mask`
    and `labels`, padded to its longest example. `columns` maps record fields to a dataset's own column names
    (`{"messages": "conversations"}`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
        packing: bool = True,
        columns: Mapping[str, str | None] | None = None,
    ) -> None:
        super().__init__()
        if seq_len < 2 or batch_size < 1 or not 0 < val_fraction < 1:
            raise ValueError(f"Bad data settings seq_len={seq_len}, batch_size={batch_size}, "
                             f"val_fraction={val_fraction}: set data.seq_len >= 2, data.batch_size >= 1 "
                             "and 0 < data.val_fraction < 1.")
        self.tokenizer, self.path, self.seq_len, self.seed = tokenizer, path, seq_len, seed
        self.batch_size, self.val_fraction, self.num_workers = batch_size, val_fraction, num_workers
        self.columns = dict(columns or {})
        self.packing = packing and path is not None  # the built-in corpus is in full windows already
        self.collate = partial(pad_rows, pad_id=tokenizer.pad_token_id) if self.packing else DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")

    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        if self.path is None:
            examples = builtin_examples(self.tokenizer, self.seq_len)
        else:
            examples = local_examples(self.path, self.tokenizer, self.seq_len, self.columns)
        if len(examples) < 2:
            raise ValueError(f"{self.path or 'the built-in corpus'} gives {len(examples)} usable example(s); "
                             "at least 2 are needed (one is held out for validation).")
        n_val = max(1, round(len(examples) * self.val_fraction))
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(examples, [len(examples) - n_val, n_val], generator)
        if self.packing:
            self.train_set, self.val_set = (PackedRows(split, self.seq_len) for split in (self.train_set, self.val_set))
            rank_zero_info(self.packing_report())

    def packing_report(self) -> str:
        """How many rows the training examples took, and the padding of the first epoch's batches unpacked and
        packed (each batch padded to its longest example or row)."""
        rows = self.train_set
        before = first_epoch_padding([len(e["input_ids"]) for e in rows.examples], self.batch_size, self.seed)
        after = first_epoch_padding(rows.row_lengths, self.batch_size, self.seed)
        return (f"packing: {len(rows.examples)} examples into {len(rows)} rows of up to {self.seq_len} tokens; "
                f"padding {before:.1%} -> {after:.1%}")

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled by (seed, epoch), its position saved in every checkpoint: a resumed run sees the same batches."""
        return ResumableDataLoader(self.train_set, seed=self.seed, **self._loader_settings())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, shuffle=False, **self._loader_settings())

    def _loader_settings(self) -> dict[str, Any]:
        return dict(batch_size=self.batch_size, collate_fn=self.collate, num_workers=self.num_workers,
                    persistent_workers=self.num_workers > 0)


def first_epoch_padding(lengths: Sequence[int], batch_size: int, seed: int) -> float:
    """The padding of the first epoch's batches of items of these lengths, each batch padded to its longest, in
    the order the train loader hands them out."""
    return batch_padding([lengths[i] for i in EpochShuffleSampler(len(lengths), seed)], batch_size)


class EpochShuffleSampler(Sampler[int]):
    """A permutation of `range(size)` that is a function of `seed + epoch` alone (as in `DistributedSampler`).

    Lightning calls `set_epoch` at the start of every epoch, so each epoch has its own order, and a run
    resumed from a checkpoint recomputes the order of the epoch it stopped in: no generator state to save.
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


class _FromPosition(Sampler[int]):
    """Another sampler's indices from position `start` on; `start` holds for one pass (the resumed one).

    It also remembers the epoch Lightning last set, for samplers that have no `set_epoch` of their own.
    """

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler, self.epoch, self.start = sampler, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        return itertools.islice(iter(self.sampler), start, None)

    def __len__(self) -> int:
        return len(self.sampler)


class ResumableDataLoader(DataLoader):
    """A `DataLoader` whose place in the data (epoch, samples handed out) is saved and restored by Lightning.

    Lightning's fit loop stores `state_dict()` of a train loader that has one in the checkpoint, under
    `loops.fit_loop.state_dict.combined_loader`, and calls `load_state_dict` before the resumed run iterates:
    the run then continues with exactly the batches an uninterrupted run would have seen next. Samples count
    as handed out when a batch leaves this loader, not when the sampler yields them: worker processes draw
    indices ahead (prefetch), and those batches were never trained on. The resumed pass skips indices, not
    data, so it starts without loading what it skips. By default the order is an `EpochShuffleSampler`'s;
    a given `sampler` (e.g. the sequential one Lightning swaps in for `overfit_batches`) resumes the same way.
    The loader draws worker seeds from a generator of its own, so data loading never moves the global RNG.
    """

    def __init__(self, dataset: Dataset, sampler: Sampler[int] | None = None, seed: int = 0, **settings: Any) -> None:
        if sampler is None:
            sampler = EpochShuffleSampler(len(dataset), seed)
        settings.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(dataset, sampler=_FromPosition(sampler), **settings)
        self._position = {"epoch": 0, "samples": 0}  # of the latest pass
        self._resume_at: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        """Batches of the current epoch from its start, or (once, after `load_state_dict`) from the saved place.

        A generator, so nothing runs until the first batch is asked for: by then Lightning has set the epoch.
        """
        sampler = self.sampler
        resume, self._resume_at = self._resume_at, None
        start = resume["samples"] if resume is not None and resume["epoch"] == sampler.epoch else 0
        sampler.start = start
        self._position = {"epoch": sampler.epoch, "samples": start}
        for batch in super().__iter__():
            self._position["samples"] = min(self._position["samples"] + self.batch_size, len(sampler))
            yield batch

    def state_dict(self) -> dict[str, int]:
        return dict(self._position)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if set(state_dict) != {"epoch", "samples"}:
            raise ValueError(f"A ResumableDataLoader state holds 'epoch' and 'samples'; this one holds "
                             f"{sorted(state_dict)}. Resume from a checkpoint written with this train loader.")
        self._resume_at = {"epoch": int(state_dict["epoch"]), "samples": int(state_dict["samples"])}
        self._position = dict(self._resume_at)
