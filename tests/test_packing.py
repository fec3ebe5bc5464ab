"""Packing: examples share rows, and every token still gets the loss it gets alone; training on packed batches
under the sliding strategy is Lightning's own training with torch's AdamW."""

import copy
import json
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_slide import SlideStrategy
from lightning_slide.data import IGNORE_INDEX, EpochShuffleSampler, TextDataModule, byte_tokenizer
from lightning_slide.lm import CausalLMModule
from lightning_slide.models import build_model, model_config
from lightning_slide.packing import model_inputs, non_padding_tokens, pack, packed_row, pad_rows
from tests.runtime.helpers import relative_difference, trainer
from tests.test_chat_data import chat_jsonl, chat_model_folder, chat_tokenizer, run_train_script

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97


def lengths_in(rows: list[list[int]], lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for i in row) for row in rows]


def test_every_example_goes_into_exactly_one_row_within_seq_len():
    rng = random.Random(0)
    lengths = [rng.randint(2, 64) for _ in range(500)]
    rows = pack(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert max(lengths_in(rows, lengths)) <= 64
    assert pack(lengths, 64) == rows  # a function of the lengths alone


def test_best_fit_decreasing_puts_each_example_where_it_leaves_least_room():
    # longest first: 7 and 6 open a row each (room 3 and 4); 3 goes beside 7, where it leaves no room, rather
    # than beside 6; 2 and then 1 go beside 6, the only row with room left.
    assert pack([3, 7, 2, 6, 1], 10) == [[1, 0], [3, 2, 4]]


def test_packed_rows_restart_positions_and_mask_each_examples_first_label():
    a = {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}
    b = {"input_ids": [8, 9], "labels": [8, 9]}
    row = packed_row([a, b])
    assert row == {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9],
                   "position_ids": [0, 1, 2, 0, 1]}
    batch = pad_rows([row, packed_row([b])], pad_id=0)
    assert batch["input_ids"][1].tolist() == [8, 9, 0, 0, 0]
    assert batch["labels"][1].tolist() == [IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 0, 0]


def test_non_padding_tokens_counts_real_tokens_of_packed_and_padded_batches():
    rows = [packed_row([{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]) for lengths in ([3, 2], [4])]
    assert int(non_padding_tokens(pad_rows(rows, pad_id=0))) == 9
    padded = {"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert int(non_padding_tokens(padded)) == 8


def tiny_llama(attention: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each position's next-token loss (0 where the label is -100)."""
    logits = model(**model_inputs(batch, model)).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=IGNORE_INDEX,
                           reduction="none")


def assert_each_packed_token_gets_its_loss_alone(model: torch.nn.Module, device: str = "cpu", tol: float = 1e-5):
    g = torch.Generator().manual_seed(1)
    examples = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 4, 13, 6, 2, 11)]
    rows = [[examples[i] for i in row] for row in pack([len(e) for e in examples], 24)]
    batch = pad_rows([packed_row([{"input_ids": e, "labels": e} for e in row]) for row in rows], pad_id=0)
    with torch.no_grad():
        packed = token_losses(model, {k: v.to(device) for k, v in batch.items()})
        for r, row in enumerate(rows):
            start = 0
            for ids in row:
                one = torch.tensor([ids], device=device)
                alone = token_losses(model, {"input_ids": one, "labels": one, "attention_mask": torch.ones_like(one)})
                torch.testing.assert_close(packed[r, start : start + len(ids) - 1], alone[0], rtol=tol, atol=tol / 10)
                if start:  # the previous example's last token is not trained to predict this one's first
                    assert packed[r, start - 1] == 0
                start += len(ids)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_token_of_a_packed_row_gets_the_loss_it_gets_alone(attention):
    assert_each_packed_token_gets_its_loss_alone(tiny_llama(attention))


@pytest.mark.gpu
def test_on_cuda_with_the_kernels_each_packed_token_gets_the_loss_it_gets_alone():
    """Triton RMSNorm, SwiGLU and RoPE (cos/sin per row: positions differ row by row) and CUDA sdpa."""
    from lightning_slide import ops

    model = tiny_llama("sdpa").cuda()
    with ops.patch(model):
        assert_each_packed_token_gets_its_loss_alone(model, "cuda", tol=1e-4)


def test_packed_rows_are_refused_under_flash_attention_with_several_rows():
    model = tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = pad_rows([packed_row([{"input_ids": [1, 2], "labels": [1, 2]}])] * 2, pad_id=0)
    with pytest.raises(ValueError, match=r"'flash_attention_2'.*data.batch_size=1.*attn_implementation='sdpa'"):
        model_inputs(batch, model)
    assert set(model_inputs({k: v[:1] for k, v in batch.items()}, model)) == {"input_ids", "position_ids", "use_cache"}


def records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/response pairs of long-tailed lengths."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice("abcdefgh ij\n") for _ in range(k))  # noqa: E731
    return [{"prompt": text(rng.randint(2, 12)), "response": text(int(rng.lognormvariate(2.5, 0.8)) + 1)}
            for _ in range(n)]


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_packed_batches_hold_each_example_whole_with_its_loss_mask(tmp_path):
    path = write(tmp_path / "d.jsonl", records(40))
    tokenizer = byte_tokenizer()
    unpacked = TextDataModule(tokenizer, path, seq_len=96, batch_size=4, packing=False)
    packed = TextDataModule(tokenizer, path, seq_len=96, batch_size=4)
    unpacked.setup("fit"), packed.setup("fit")
    alone = {tuple(e["input_ids"]): e["labels"] for e in unpacked.train_set}
    seen = []
    for batch in packed.train_dataloader():
        assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape[1] <= 96
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            starts = [i for i, p in enumerate(positions.tolist()) if p == 0] + [len(ids)]
            for start, end in zip(starts, starts[1:]):
                if end - start > 1:  # a real example (two tokens at least), not a pad token
                    seen.append(tuple(ids[start:end].tolist()))
                    assert labels[start:end].tolist() == [IGNORE_INDEX, *alone[seen[-1]][1:]]
    assert sorted(seen) == sorted(alone)


def padding_of(loader) -> float:
    batches = list(loader)
    return 1 - sum(int(non_padding_tokens(b)) for b in batches) / sum(b["input_ids"].numel() for b in batches)


def test_the_logged_padding_is_that_of_the_first_epochs_batches_unpacked_and_packed(tmp_path, caplog):
    path = write(tmp_path / "d.jsonl", records(200))
    settings = dict(seq_len=128, batch_size=8, seed=3)
    unpacked = TextDataModule(byte_tokenizer(), path, packing=False, **settings)
    packed = TextDataModule(byte_tokenizer(), path, **settings)
    unpacked.setup("fit")
    with caplog.at_level("INFO"):
        packed.setup("fit")
    figures = re.search(r"packing: (\d+) examples into (\d+) rows of up to 128 tokens; padding ([\d.]+)% -> ([\d.]+)%",
                        caplog.text)
    assert figures, caplog.text
    examples, rows, before, after = (float(x) for x in figures.groups())
    assert (examples, rows) == (len(unpacked.train_set), len(packed.train_set))
    assert before == pytest.approx(100 * padding_of(unpacked.train_dataloader()), abs=0.051)
    assert after == pytest.approx(100 * padding_of(packed.train_dataloader()), abs=0.051)
    assert after < before / 5


def test_the_builtin_corpus_is_not_packed():
    data = TextDataModule(byte_tokenizer(), seq_len=32, batch_size=4)
    data.setup("fit")
    assert set(next(iter(data.train_dataloader()))) == {"input_ids", "attention_mask", "labels"}


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_sliding_training_on_packed_batches_matches_lightnings_single_device_adamw(tmp_path, recompute):
    """The packed batch's 4-D masks and position ids reach every block in its forward and in its recompute (or
    its kept graph); validation on packed rows gives the same loss."""
    path = write(tmp_path / "d.jsonl", records(40))
    model = build_model(model_config("tiny", num_hidden_layers=2))
    results = []
    for strategy in ("auto", SlideStrategy(recompute=recompute)):
        data = TextDataModule(byte_tokenizer(), path, seq_len=96, batch_size=3)
        module = CausalLMModule(copy.deepcopy(model), lr=3e-3, warmup_steps=1)
        fit = trainer(strategy, 4, val_check_interval=2)
        fit.fit(module, datamodule=data)
        results.append((module.model, float(fit.callback_metrics["val/loss"])))
    (expected, expected_val), (got, got_val) = results
    assert relative_difference(expected, got) <= 1e-6
    assert got_val == pytest.approx(expected_val, rel=1e-5)


def test_train_script_packs_chat_records_and_its_first_loss_is_each_examples_own(tmp_path):
    pretrained, data = chat_model_folder(tmp_path), chat_jsonl(tmp_path / "chat.jsonl", 24)
    cfg, first_loss = run_train_script(tmp_path / "run", [
        f"model.pretrained={pretrained}", "data=jsonl", f"data.path={data}", "data.batch_size=2", "data.seq_len=400",
        "trainer.max_steps=1", "trainer.log_every_n_steps=1", "checkpoint=null"])

    datamodule = TextDataModule(chat_tokenizer(), str(data), seq_len=400, batch_size=2, seed=cfg.seed)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))  # the packed batch the run trained on first
    rows_of_batch = [datamodule.train_set.rows[i] for i in list(EpochShuffleSampler(len(datamodule.train_set),
                                                                                     cfg.seed))[:2]]
    model = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    losses = []
    for row in rows_of_batch:
        for example in (datamodule.train_set.examples[i] for i in row):
            ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"])
            logits = model(input_ids=ids).logits[0, :-1]
            losses.append(F.cross_entropy(logits, labels[1:], ignore_index=IGNORE_INDEX, reduction="none")[
                labels[1:] != IGNORE_INDEX])
    assert batch["input_ids"].shape[0] == 2 and sum(map(len, rows_of_batch)) > 2  # rows hold several examples
    assert first_loss == pytest.approx(torch.cat(losses).mean().item(), rel=1e-5)
