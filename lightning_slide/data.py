"""Training data: a built-in corpus that needs no download, and JSONL files of text or prompt/response records.

Every example is a dict of token lists with `labels` (-100 where no loss is taken: prompts and padding),
so the module computes one kind of loss whatever the source.
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import DataLoader, random_split
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, PreTrainedTokenizerBase, PreTrainedTokenizerFast

IGNORE_INDEX = -100

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


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    """Records of a JSONL file, each {"text"} or {"prompt", "response"}; errors name the file and line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist. Point data.path at a JSONL file.")
    records = []
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if line.strip():
                records.append(_parse_record(line, f"{path}:{lineno}"))
    if not records:
        raise ValueError(f"{path} holds no records. Write one JSON object per line, "
                         'e.g. {"text": "..."} or {"prompt": "...", "response": "..."}.')
    return records


def _parse_record(line: str, where: str) -> dict[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}). "
                         "Each line must be one JSON object.") from None
    if isinstance(record, dict) and (
        isinstance(record.get("text"), str) or all(isinstance(record.get(k), str) for k in ("prompt", "response"))
    ):
        return record
    found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise ValueError(f'{where}: a record needs a string "text", or string "prompt" and "response"; '
                     f"this one has {found}.")


def encode_record(record: dict[str, str], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> dict[str, list[int]]:
    """Tokens of one record, cut to `seq_len`, with loss on the text or on the response only."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if isinstance(record.get("text"), str):
        prompt, target = [], tokenizer(record["text"])["input_ids"] + eos
    else:
        prompt = tokenizer(record["prompt"])["input_ids"]
        target = tokenizer(record["response"], add_special_tokens=False)["input_ids"] + eos
    input_ids = (prompt + target)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt) + target)[:seq_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def jsonl_examples(path: str | Path, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[dict[str, list[int]]]:
    """Encoded records of a JSONL file, skipping (with a warning) those whose response lies past `seq_len`."""
    encoded = [encode_record(r, tokenizer, seq_len) for r in read_jsonl(path)]
    examples = [e for e in encoded if any(label != IGNORE_INDEX for label in e["labels"][1:])]
    if len(examples) < len(encoded):
        warnings.warn(f"{len(encoded) - len(examples)} record(s) of {path} have no response token within "
                      f"data.seq_len={seq_len} and were skipped; raise data.seq_len to keep them.", stacklevel=2)
    return examples


class TextDataModule(L.LightningDataModule):
    """Batches for causal-LM fine-tuning: the built-in corpus (`path=None`) or a JSONL file.

    A seeded random `val_fraction` of the examples (at least one) is held out for validation.
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
    ) -> None:
        super().__init__()
        if seq_len < 2 or batch_size < 1 or not 0 < val_fraction < 1:
            raise ValueError(f"Bad data settings seq_len={seq_len}, batch_size={batch_size}, "
                             f"val_fraction={val_fraction}: set data.seq_len >= 2, data.batch_size >= 1 "
                             "and 0 < data.val_fraction < 1.")
        self.tokenizer, self.path, self.seq_len, self.seed = tokenizer, path, seq_len, seed
        self.batch_size, self.val_fraction, self.num_workers = batch_size, val_fraction, num_workers
        self.collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")

    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        if self.path is None:
            examples = builtin_examples(self.tokenizer, self.seq_len)
        else:
            examples = jsonl_examples(self.path, self.tokenizer, self.seq_len)
        if len(examples) < 2:
            raise ValueError(f"{self.path or 'the built-in corpus'} gives {len(examples)} usable example(s); "
                             "at least 2 are needed (one is held out for validation).")
        n_val = max(1, round(len(examples) * self.val_fraction))
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(examples, [len(examples) - n_val, n_val], generator)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: torch.utils.data.Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, collate_fn=self.collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
