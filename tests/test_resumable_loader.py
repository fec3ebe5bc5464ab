"""The train loader's place in the data is part of the checkpoint: a resumed fit sees exactly the batches an
uninterrupted fit would have seen next, mid-epoch or at an epoch's end, with or without workers and accumulation."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import SequentialSampler

from lightning_slide.data import EpochShuffleSampler, ResumableDataLoader, TextDataModule, byte_tokenizer

SIZE, BATCH = 22, 2  # 11 batches per epoch, the last one full: an odd count, so accumulation of 2 straddles it


class RecordsBatches(L.LightningModule):
    """Notes (global step, epoch, sample ids) for every training batch; its one weight never moves."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.trainer.global_step, self.current_epoch, batch.tolist()))
        return self.weight * batch.float().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Indices(L.LightningDataModule):
    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.num_workers = num_workers

    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(list(range(SIZE)), batch_size=BATCH, num_workers=self.num_workers,
                                   persistent_workers=self.num_workers > 0, seed=7)


def fit(root: Path, steps: int, num_workers: int = 0, accumulate: int = 1, limit: int | None = None,
        ckpt_path: Path | None = None, every_step: bool = False) -> list[tuple[int, int, list[int]]]:
    module = RecordsBatches()
    callbacks = [ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)] if every_step else []
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, limit_train_batches=limit,
                        callbacks=callbacks, enable_checkpointing=every_step, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, datamodule=Indices(num_workers), ckpt_path=ckpt_path)
    return module.seen


def test_an_epochs_order_is_a_permutation_fixed_by_seed_and_epoch():
    sampler = EpochShuffleSampler(SIZE, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(SIZE)) and list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(EpochShuffleSampler(SIZE, seed=4)) != first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loaded_state_continues_with_the_batches_not_yet_handed_out(num_workers):
    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(list(range(SIZE)), batch_size=BATCH, num_workers=num_workers, seed=1)

    straight = [b.tolist() for b in loader()]
    batches = iter(interrupted := loader())
    for _ in range(4):
        next(batches)
    state = interrupted.state_dict()  # with workers, more batches than these four are already prefetched
    assert state == {"epoch": 0, "samples": 4 * BATCH}
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == straight[4:]
    assert [b.tolist() for b in resumed] == straight  # the next pass starts the epoch over


def test_a_state_saved_in_another_epoch_starts_the_current_one_from_its_start():
    loader = ResumableDataLoader(list(range(SIZE)), batch_size=BATCH)
    loader.load_state_dict({"epoch": 0, "samples": SIZE})  # saved at the end of epoch 0
    loader.sampler.set_epoch(1)
    epoch_1 = EpochShuffleSampler(SIZE)
    epoch_1.set_epoch(1)
    assert torch.cat(list(loader)).tolist() == list(epoch_1)


@pytest.mark.parametrize(
    "num_workers, accumulate, limit",
    [(0, 1, None), (2, 1, None), (0, 2, None), (0, 1, 5), (2, 2, 5)],
    ids=["plain", "workers", "accumulate", "short-epochs", "workers-accumulate-short-epochs"],
)
def test_resuming_from_any_step_sees_what_the_uninterrupted_fit_saw_after_it(num_workers, accumulate, limit,
                                                                             tmp_path):
    """Every checkpoint of a 3-epoch fit: mid-epoch, on an epoch's last batch, and (accumulating) on the step that
    ends an epoch with fewer batches than it accumulates."""
    steps = 2 * math.ceil((limit or SIZE // BATCH) / accumulate) + 2
    straight = fit(tmp_path, steps, num_workers, accumulate, limit, every_step=True)
    assert len({epoch for _, epoch, _ in straight}) >= 3
    for step in range(1, steps):
        checkpoint = tmp_path / f"step={step}.ckpt"
        resumed = fit(tmp_path / "resumed", steps, num_workers, accumulate, limit, ckpt_path=checkpoint)
        assert resumed == [seen for seen in straight if seen[0] >= step], f"resumed from step {step}"


def test_the_position_is_saved_with_the_fit_loop(tmp_path):
    fit(tmp_path, 3, every_step=True)
    checkpoint = torch.load(tmp_path / "step=3.ckpt", weights_only=True)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "samples": 3 * BATCH}]


def test_a_given_sampler_resumes_the_same_way():
    """Lightning swaps in a sequential sampler for `overfit_batches`; the loader still resumes it."""
    loader = ResumableDataLoader(list(range(SIZE)), sampler=SequentialSampler(range(SIZE)), batch_size=BATCH)
    loader.load_state_dict({"epoch": 0, "samples": 6})
    assert torch.cat(list(loader)).tolist() == list(range(6, SIZE))


def test_a_state_of_another_loader_is_refused():
    loader = ResumableDataLoader(list(range(SIZE)), batch_size=BATCH)
    with pytest.raises(ValueError, match="holds 'epoch' and 'samples'; this one holds \\['_num_yielded'\\]"):
        loader.load_state_dict({"_num_yielded": 3})


def test_the_data_module_trains_on_a_resumable_loader_and_validates_in_order():
    data = TextDataModule(byte_tokenizer(), seq_len=32, batch_size=4, seed=5)
    data.setup("fit")
    train, val = data.train_dataloader(), data.val_dataloader()
    assert isinstance(train, ResumableDataLoader) and train.sampler.sampler.seed == 5
    assert isinstance(val.sampler, SequentialSampler)
    assert next(iter(train))["input_ids"].shape == (4, 32)
