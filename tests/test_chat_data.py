"""Chat records: rendered with the tokenizer's chat template, trained on the assistant turns and their end-of-turn."""

import csv
import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from lightning_slide.data import IGNORE_INDEX, TextDataModule, byte_tokenizer, encode_record, local_examples
from lightning_slide.models import build_model, model_config

ROOT = Path(__file__).resolve().parents[1]

#: ChatML-like: a header line per turn, the content, then the end-of-turn token (the eos) and a newline.
PLAIN = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
#: The same rendering, with the assistant content and its end-of-turn inside generation markers.
MARKED = ("{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
          "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Perú?"},
    {"role": "assistant", "content": "Lima."},
]


def chat_tokenizer(template: str | None = PLAIN):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def expected_labels(messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids and labels built turn by turn (byte tokens compose): loss on assistant content + its end-of-turn."""
    tokenizer = chat_tokenizer()
    ids, labels = [], []
    for m in messages:
        header = tokenizer(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        ids += header + body + newline
        trained = body if m["role"] == "assistant" else [IGNORE_INDEX] * len(body)
        labels += [IGNORE_INDEX] * len(header) + trained + [IGNORE_INDEX] * len(newline)
    return ids, labels


@pytest.mark.parametrize("template", [PLAIN, MARKED], ids=["prefixes", "generation-markers"])
def test_chat_record_is_tokenized_as_apply_chat_template_renders_it(template):
    tokenizer = chat_tokenizer(template)
    example = encode_record({"messages": CONVERSATION}, tokenizer, seq_len=1000)
    assert example["input_ids"] == tokenizer.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
    assert example["attention_mask"] == [1] * len(example["input_ids"])


@pytest.mark.parametrize("template", [PLAIN, MARKED, {"default": MARKED, "tool_use": PLAIN}],
                         ids=["prefixes", "generation-markers", "named-templates"])
def test_loss_is_only_on_assistant_contents_and_their_end_of_turn(template):
    example = encode_record({"messages": CONVERSATION}, chat_tokenizer(template), seq_len=1000)
    ids, labels = expected_labels(CONVERSATION)
    assert example["input_ids"] == ids
    assert example["labels"] == labels
    assert labels.count(chat_tokenizer().eos_token_id) == 2  # one end-of-turn per assistant turn


@pytest.mark.parametrize("template", [PLAIN, MARKED], ids=["prefixes", "generation-markers"])
def test_truncation_at_seq_len_keeps_labels_aligned_with_tokens(template):
    ids, labels = expected_labels(CONVERSATION)
    cut = [i for i, label in enumerate(labels) if label != IGNORE_INDEX][-3]  # inside "Lima."
    example = encode_record({"messages": CONVERSATION}, chat_tokenizer(template), seq_len=cut)
    assert example["input_ids"] == ids[:cut] and example["labels"] == labels[:cut]


def test_a_tokenizer_without_chat_template_is_refused_naming_the_settings(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(ValueError, match=r'model\.pretrained at a folder whose tokenizer has a chat template.*prompt'):
        local_examples(path, chat_tokenizer(None), seq_len=64)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = "{% for m in messages %}{{ m.content if loop.last else m.role }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"renders the turns before message 2 differently.*\{% generation %\}"):
        encode_record({"messages": CONVERSATION}, chat_tokenizer(rewriting), seq_len=64)


def test_a_conversation_with_no_assistant_token_within_seq_len_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "chat.jsonl"
    long = [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]
    path.write_text(json.dumps({"messages": long}) + "\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.warns(UserWarning, match=r"1 record\(s\) .* no response or assistant token within data\.seq_len=128"):
        examples = local_examples(path, chat_tokenizer(), seq_len=128)
    assert len(examples) == 1


def test_one_file_may_mix_chat_prompt_response_and_text_records(tmp_path):
    path = tmp_path / "mixed.jsonl"
    records = [{"messages": CONVERSATION}, {"prompt": "Q? ", "response": "A."}, {"text": "plain text"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = chat_tokenizer()
    assert local_examples(path, tokenizer, seq_len=1000) == [encode_record(r, tokenizer, 1000) for r in records]
    assert local_examples(path, tokenizer, seq_len=1000)[0]["labels"] == expected_labels(CONVERSATION)[1]


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}], r"messages\[1\] must be"),
    ([{"role": "user", "content": "hi"}], "no message has the role 'assistant'"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello"}], "starts with a system or user"),
], ids=["empty", "unknown-role", "no-assistant", "assistant-first"])
def test_a_malformed_chat_record_names_its_line(messages, problem, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=rf"chat\.jsonl:3: a chat record's .*{problem}"):
        local_examples(path, chat_tokenizer(), seq_len=64)


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Square it."}, {"role": "user", "content": f"{i}?"},
            {"role": "assistant", "content": f"{i * i}."}, {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": f"{i * i}!"}]


def chat_model_folder(tmp_path: Path) -> Path:
    """A one-block tiny model saved with the chat tokenizer: a model.pretrained folder."""
    folder = tmp_path / "pretrained"
    build_model(model_config("tiny", num_hidden_layers=1)).save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


def chat_jsonl(path: Path, count: int) -> Path:
    """A JSONL file of `count` conversations."""
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(count)))
    return path


def run_train_script(run_dir: Path, overrides: list[str]) -> tuple[DictConfig, float]:
    """train.py with these overrides, writing into run_dir: its config and its first logged training loss."""
    train = runpy.run_path(str(ROOT / "train.py"))["train"]  # also registers the config nodes train.yaml uses
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg, run_dir)
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return cfg, next(float(row["train/loss"]) for row in rows if row.get("train/loss"))


def test_train_script_fine_tunes_on_chat_jsonl_and_its_first_loss_is_plain_pytorch_on_the_masked_batch(tmp_path):
    pretrained, data = chat_model_folder(tmp_path), chat_jsonl(tmp_path / "chat.jsonl", 12)
    cfg, first_loss = run_train_script(tmp_path / "run", [
        f"model.pretrained={pretrained}", "data=jsonl", f"data.path={data}", "data.batch_size=4", "trainer.max_steps=2",
        "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "data.packing=false"])

    datamodule = TextDataModule(chat_tokenizer(), str(data), seq_len=cfg.data.seq_len, batch_size=4, seed=cfg.seed,
                                packing=False)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))  # the batch the run trained on first (epoch 0, same seed)
    by_ids = {tuple(ids): labels for ids, labels in (expected_labels(conversation(i)) for i in range(12))}
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    for row, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
        labels[row, : int(mask.sum())] = torch.tensor(by_ids[tuple(ids[mask.bool()].tolist())])
    model = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    assert torch.equal(batch["labels"], labels)
    assert first_loss == pytest.approx(reference.item(), rel=1e-5)
