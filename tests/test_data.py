"""Data: the built-in corpus, JSONL records with prompt masking, batching, and clear errors for bad files."""

import json
import random

import pytest
import torch

from lightning_slide.data import (
    IGNORE_INDEX,
    TextDataModule,
    builtin_examples,
    byte_tokenizer,
    encode_record,
)
from lightning_slide.models import model_config
from lightning_slide.sources import read_records


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def random_text(n: int) -> str:
    return "".join(random.choice("abcdefghij XYZ\n\té€😀{}\"") for _ in range(n))


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_byte_tokenizer_round_trips_any_text(tokenizer):
    text = random_text(200)
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_byte_tokenizer_fits_the_tiny_model_vocabulary(tokenizer):
    assert len(tokenizer) <= model_config("tiny").vocab_size


def test_builtin_corpus_is_packed_into_full_windows_with_loss_everywhere(tokenizer):
    examples = builtin_examples(tokenizer, seq_len=64)
    assert len(examples) > 1000
    assert all(len(e["input_ids"]) == 64 and e["labels"] == e["input_ids"] for e in examples)


def test_prompt_response_record_takes_loss_on_response_only(tokenizer):
    prompt, response = random_text(13), random_text(7)
    example = encode_record({"prompt": prompt, "response": response}, tokenizer, seq_len=512)
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert example["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert example["labels"][n_prompt:] == example["input_ids"][n_prompt:]
    assert tokenizer.decode(example["labels"][n_prompt:], skip_special_tokens=True) == response
    assert example["labels"][-1] == tokenizer.eos_token_id


def test_text_record_takes_loss_on_every_token(tokenizer):
    example = encode_record({"text": random_text(30)}, tokenizer, seq_len=512)
    assert example["labels"] == example["input_ids"]


def test_records_are_cut_to_seq_len(tokenizer):
    example = encode_record({"prompt": random_text(50), "response": random_text(50)}, tokenizer, seq_len=64)
    assert len(example["input_ids"]) == len(example["labels"]) == 64


def test_batches_pad_with_masked_positions(tmp_path, tokenizer):
    records = [{"prompt": random_text(random.randint(3, 30)), "response": random_text(random.randint(3, 30))}
               for _ in range(8)]
    data = TextDataModule(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", records)), batch_size=8,
                          val_fraction=0.2, packing=False)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    padding = batch["attention_mask"] == 0
    assert padding.any()
    assert (batch["labels"][padding] == IGNORE_INDEX).all()
    assert (batch["input_ids"][padding] == tokenizer.pad_token_id).all()


def test_validation_split_is_held_out_and_seeded(tmp_path, tokenizer):
    path = str(write_jsonl(tmp_path / "d.jsonl", [{"text": f"record {i}"} for i in range(20)]))
    splits = []
    for _ in range(2):
        data = TextDataModule(tokenizer, path=path, val_fraction=0.1, seed=3, packing=False)
        data.setup("fit")
        splits.append(sorted(data.val_set.indices))
    assert len(splits[0]) == 2 and splits[0] == splits[1]
    assert not set(splits[0]) & set(data.train_set.indices)


def test_bad_json_line_is_named_by_line_number(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "", '{"text": "broken'])
    with pytest.raises(ValueError, match=r"d\.jsonl:3: not valid JSON"):
        read_records(path)


def test_record_without_known_keys_names_its_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"prompt": "only a prompt"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: .*\"prompt\" and \"response\".*\['prompt'\]"):
        read_records(path)


def test_empty_file_says_what_a_record_looks_like(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [""])
    with pytest.raises(ValueError, match="holds no records.*prompt"):
        read_records(path)


def test_missing_file_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path="):
        read_records(tmp_path / "absent.jsonl")


def test_record_with_response_past_seq_len_is_skipped_with_warning(tmp_path, tokenizer):
    records = [{"prompt": random_text(100), "response": "late"}] + [{"text": random_text(10)} for _ in range(3)]
    data = TextDataModule(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", records)), seq_len=32,
                          packing=False)
    with pytest.warns(UserWarning, match="1 record.*raise data.seq_len"):
        data.setup("fit")
    assert len(data.train_set) + len(data.val_set) == 3


def test_bad_batch_size_names_the_setting(tokenizer):
    with pytest.raises(ValueError, match="data.batch_size >= 1"):
        TextDataModule(tokenizer, batch_size=0)


def test_batches_hold_token_tensors(tokenizer):
    data = TextDataModule(tokenizer, seq_len=32, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == torch.long
