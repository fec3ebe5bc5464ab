"""Where training records come from: a JSONL file, or a local Hugging Face `datasets` dataset.

A record is {"text"}, {"prompt", "response"} or {"messages": [{"role", "content"}, ...]}; its keys decide its
format (`data.py`), so one source may mix them. `data.path` is one of:

- a JSONL file: one record per line;
- a folder written by `datasets`' `save_to_disk` (of a `DatasetDict`: its "train" split);
- parquet or arrow files: one file, or a folder of them (read by `datasets`' parquet and arrow builders, which
  keep an arrow copy in the datasets cache, HF_DATASETS_CACHE, as `load_dataset` always does).

`columns` names the dataset's column for each record field where it is called otherwise
(`{"messages": "conversations"}`); only those columns are read. Nothing is downloaded: every source is local.
The `datasets` package is needed for the dataset forms only (`pip install 'lightning-slide[datasets]'`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning_slide.chat import chat_record_problem

FIELDS = ("text", "prompt", "response", "messages")
#: file suffix -> the `datasets` builder that reads it
TABLE_FILES = {".parquet": "parquet", ".arrow": "arrow"}
SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
EXAMPLE = ('e.g. {"text": "..."}, {"prompt": "...", "response": "..."} or '
           '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}')


def read_records(path: str | Path, columns: Mapping[str, str | None] | None = None) -> list[dict[str, Any]]:
    """Every record of `data.path`, checked; errors name the file and line (or row)."""
    path = Path(path).expanduser()
    column_of = _columns(columns)
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist. Point data.path at a JSONL file, a folder "
                                "written by datasets' save_to_disk, or parquet/arrow files (a file or a folder).")
    if path.is_file() and path.suffix.lower() not in TABLE_FILES:
        rows = ((f"{path}:{n}", _renamed(row, column_of)) for n, row in _jsonl_rows(path))
    else:
        rows = ((f"{path} row {i}", row) for i, row in enumerate(_dataset_rows(path, column_of)))
    records = [check_record(row, where) for where, row in rows]
    if not records:
        raise ValueError(f"{path} holds no records. Write one record per line (JSONL) or row, {EXAMPLE}.")
    return records


def _columns(columns: Mapping[str, str | None] | None) -> dict[str, str]:
    """field -> the column that holds it, for every field (a field mapped to None is its own column)."""
    unknown = sorted(set(columns or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"data.columns names {unknown}, which are not record fields: it maps a field "
                         f"({', '.join(FIELDS)}) to the column that holds it, e.g. data.columns={{messages: "
                         "conversations}.")
    return {field: str((columns or {}).get(field) or field) for field in FIELDS}


def _renamed(row: Any, column_of: dict[str, str]) -> Any:
    if not isinstance(row, dict) or all(field == column for field, column in column_of.items()):
        return row
    return {field: row[column] for field, column in column_of.items() if column in row}


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}). "
                                 "Each line must be one JSON object.") from None


def _dataset_rows(path: Path, column_of: dict[str, str]) -> Iterator[dict[str, Any]]:
    """The rows of a local dataset, with the columns that hold record fields renamed to them."""
    dataset = load_local_dataset(path)
    present = {field: column for field, column in column_of.items() if column in dataset.column_names}
    if not present:
        raise ValueError(f"{path} has the columns {dataset.column_names}, none of which holds a record field "
                         f"({', '.join(FIELDS)}): name the column of each with data.columns, e.g. "
                         "data.columns={messages: conversations} or data.columns={text: body}.")
    dataset = dataset.select_columns(list(present.values()))
    for row in dataset:
        yield {field: row[column] for field, column in present.items()}


def load_local_dataset(path: Path) -> Any:
    """The `datasets.Dataset` at `path`: a save_to_disk folder, or parquet/arrow files."""
    if path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET):
        datasets = _import_datasets(path)
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"data.path={str(path)!r} holds the splits {sorted(loaded)}, none named 'train': "
                                 f"point data.path at the folder of one ({path}/<split>).")
            loaded = loaded["train"]
        return loaded
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.suffix.lower() in TABLE_FILES)
    kinds = sorted({TABLE_FILES[f.suffix.lower()] for f in files})
    if len(kinds) != 1:
        found = "holds no parquet or arrow file" if not kinds else "mixes parquet and arrow files"
        raise ValueError(f"data.path={str(path)!r} {found} and is no save_to_disk folder: point it at a JSONL file, "
                         "a save_to_disk folder, or parquet/arrow files of one kind (a file or a folder).")
    return _import_datasets(path).load_dataset(kinds[0], data_files=[str(f) for f in files], split="train")


def _import_datasets(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data.path={str(path)!r} is a dataset, not a JSONL file; reading it needs the `datasets` "
                          "package: pip install 'lightning-slide[datasets]'.") from None
    return datasets


def check_record(record: Any, where: str) -> dict[str, Any]:
    """The record if it is one of the three formats; else a ValueError naming `where` it is and what it lacks."""
    if isinstance(record, dict) and (
        isinstance(record.get("text"), str) or all(isinstance(record.get(k), str) for k in ("prompt", "response"))
    ):
        return record
    if isinstance(record, dict) and record.get("messages") is not None:
        problem = chat_record_problem(record["messages"])
        if problem is None:
            return record
        raise ValueError(f"{where}: a chat record's {problem}.")
    found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise ValueError(f'{where}: a record needs a string "text", string "prompt" and "response", or a list of '
                     f'"messages"; this one has {found}.')
