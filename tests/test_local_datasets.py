"""data.path as a local Hugging Face dataset: a save_to_disk folder, parquet or arrow files, with data.columns
naming the dataset's own columns. Nothing is downloaded."""

import math
import sys
from pathlib import Path

import pytest

from lightning_slide.data import TextDataModule, byte_tokenizer, encode_record, local_examples
from lightning_slide.sources import read_records
from tests.test_chat_data import chat_model_folder, chat_tokenizer, conversation, run_train_script

# the [datasets] extra (in [dev]); a machine without it, e.g. one running only the GPU tests, skips these
datasets = pytest.importorskip("datasets")
Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [{"body": f"record number {i} " * (i % 5 + 1), "id": i} for i in range(12)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """The arrow copies the parquet and arrow builders keep go into the test's folder."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "cache")


def first_loss(tmp_path: Path, *overrides: str) -> float:
    """train.py for two steps on the tiny chat model; its first logged training loss."""
    return run_train_script(tmp_path / "run", [
        f"model.pretrained={chat_model_folder(tmp_path)}", "data=jsonl", "data.batch_size=2", "trainer.max_steps=2",
        "trainer.log_every_n_steps=1", "checkpoint=null", *overrides])[1]


def test_train_script_fine_tunes_on_a_save_to_disk_folder_with_its_chat_column_named(tmp_path):
    rows = [{"conversations": conversation(i), "source": "synthetic"} for i in range(12)]
    Dataset.from_list(rows).save_to_disk(tmp_path / "chats")
    assert math.isfinite(first_loss(tmp_path, f"data.path={tmp_path / 'chats'}",
                                      "data.columns={messages: conversations}"))
    examples = local_examples(tmp_path / "chats", chat_tokenizer(), 512, {"messages": "conversations"})
    assert examples == [encode_record({"messages": conversation(i)}, chat_tokenizer(), 512) for i in range(12)]


def test_train_script_fine_tunes_on_a_parquet_file_with_its_text_column_named(tmp_path):
    Dataset.from_list(TEXTS).to_parquet(tmp_path / "texts.parquet")
    assert math.isfinite(first_loss(tmp_path, f"data.path={tmp_path / 'texts.parquet'}", "data.columns={text: body}"))


@pytest.mark.parametrize("form", ["parquet folder", "arrow file", "dataset dict"])
def test_every_local_form_reads_the_same_records(tmp_path, form):
    dataset = Dataset.from_list(TEXTS)
    if form == "parquet folder":
        (tmp_path / "d").mkdir()
        dataset.select(range(6)).to_parquet(tmp_path / "d" / "part-0.parquet")
        dataset.select(range(6, 12)).to_parquet(tmp_path / "d" / "part-1.parquet")
        path = tmp_path / "d"
    elif form == "arrow file":
        dataset.save_to_disk(tmp_path / "saved")
        path = next((tmp_path / "saved").glob("*.arrow"))
    else:
        DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(tmp_path / "d")
        path = tmp_path / "d"
    assert read_records(path, {"text": "body"}) == [{"text": row["body"]} for row in TEXTS]


def test_a_dataset_module_packs_local_dataset_records_as_it_packs_jsonl(tmp_path):
    Dataset.from_list([{"text": row["body"]} for row in TEXTS]).save_to_disk(tmp_path / "d")
    data = TextDataModule(byte_tokenizer(), str(tmp_path / "d"), seq_len=64, batch_size=2)
    data.setup("fit")
    assert len(data.train_set) < len(data.train_set.examples) == 11  # rows hold several examples
    assert set(next(iter(data.train_dataloader()))) == {"input_ids", "labels", "position_ids"}


def test_a_dataset_without_a_record_column_names_its_columns_and_the_setting(tmp_path):
    Dataset.from_list(TEXTS).save_to_disk(tmp_path / "d")
    with pytest.raises(ValueError, match=r"columns \['body', 'id'\].*data.columns=\{text: body\}"):
        read_records(tmp_path / "d")


def test_a_column_mapping_for_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match=r"data.columns names \['body'\], which are not record fields"):
        read_records("unused", {"body": "text"})


def test_a_dataset_dict_without_a_train_split_says_to_point_at_one(tmp_path):
    DatasetDict({"test": Dataset.from_list(TEXTS)}).save_to_disk(tmp_path / "d")
    with pytest.raises(ValueError, match=r"splits \['test'\], none named 'train'"):
        read_records(tmp_path / "d", {"text": "body"})


def test_a_folder_with_no_dataset_is_refused_naming_the_forms(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds no parquet or arrow file and is no save_to_disk folder"):
        read_records(tmp_path)


def test_without_the_datasets_package_the_error_names_the_extra(tmp_path, monkeypatch):
    Dataset.from_list(TEXTS).to_parquet(tmp_path / "texts.parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-slide\[datasets\]'"):
        read_records(tmp_path / "texts.parquet", {"text": "body"})


def test_jsonl_records_take_the_column_mapping_too(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "Q?", "answer": "A."}\n')
    assert read_records(tmp_path / "d.jsonl", {"prompt": "question", "response": "answer"}) == [
        {"prompt": "Q?", "response": "A."}]
