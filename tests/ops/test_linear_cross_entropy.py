"""Fused linear cross-entropy: loss and gradients against full-logits PyTorch, in every schedule.

Each schedule's budget (`BUDGET_ROWS`, in rows of logits) gives several blocks with a ragged last
one: 23 tokens in row chunks of 5 (last 3) with "rows"; vocabulary slices of 39 columns (36 in
bf16) over all 23 tokens (97 = 2·39 + 19) with "vocab" (three slices: the interpreter runs its
programs one by one); with "tiles", at least 8 rows a block (`TILE_ROWS`), two slices of 49 and 48
columns in blocks of 9, 9 and 5 rows (fp32) or 8, 8 and 7 (bf16).
"""
import pytest
import torch
import torch.nn.functional as F

import lightning_slide.ops.cross_entropy as lce
from lightning_slide.ops import (
    LinearCrossEntropyHead,
    causal_lm_loss,
    causal_targets,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

DTYPES = [torch.float32, torch.bfloat16]
T, H, V = 23, 16, 97  # odd sizes: 23 tokens in chunks of 5 leave a remainder of 3
SCHEDULES = lce.SCHEDULES
BUDGET_ROWS = {"rows": 5, "vocab": 10, "tiles": 5}


@pytest.fixture(autouse=True)
def _tiles_of_a_few_rows(monkeypatch):
    monkeypatch.setattr(lce, "TILE_ROWS", 8)


def _chunk_mib(rows, dtype):
    """A logits budget of `rows` rows, to force several chunks at test sizes."""
    return rows * V * torch.empty((), dtype=dtype).element_size() / 2**20


def _problem(dtype, device, bias=False):
    x = torch.randn(T, H, device=device).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, device=device)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(V, device=device)).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (T,), device=device)
    y[[2, 9, 10, 22]] = -100
    return x, w, b, y


def _check(dtype, device, assert_matches, bias=False, targets=None, schedule="rows", **kwargs):
    """Run ours in blocks and the reference in fp32 on the same inputs; compare loss and grads."""
    x, w, b, y = _problem(dtype, device, bias)
    y = y if targets is None else targets.to(device)
    inputs = [t for t in (x, w, b) if t is not None]
    refs = [t.detach().float().requires_grad_() for t in inputs]

    loss = linear_cross_entropy(x, w, y, b, chunk_mib=_chunk_mib(BUDGET_ROWS[schedule], dtype), schedule=schedule,
                                **kwargs)
    expected = linear_cross_entropy_reference(*refs[:2], y, refs[2] if bias else None, **kwargs)
    assert loss.dtype == torch.float32
    assert_matches(loss, expected, dtype)
    loss.backward()
    expected.backward()
    for got, ref in zip(inputs, refs, strict=True):
        assert_matches(got.grad, ref.grad, dtype)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_and_gradients_match_reference_over_several_chunks(dtype, schedule, device, assert_matches):
    _check(dtype, device, assert_matches, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_z_loss_match_reference(dtype, schedule, device, assert_matches):
    _check(dtype, device, assert_matches, softcap=4.0, z_loss_weight=1e-2, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bias_gets_its_gradient(schedule, device, assert_matches):
    _check(torch.float32, device, assert_matches, bias=True, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_online_log_sum_exp_across_vocabulary_blocks(schedule, device, assert_matches, monkeypatch):
    monkeypatch.setattr(lce, "CE_BLOCK", 16)  # 97 columns -> 7 blocks, a slice's 39 -> 3; the last ones masked
    _check(torch.float32, device, assert_matches, softcap=3.0, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_num_items_in_batch_divides_the_summed_loss(schedule, device, assert_matches):
    _check(torch.float32, device, assert_matches, num_items_in_batch=torch.tensor(40), schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rows_with_every_label_ignored_contribute_nothing(schedule, device, assert_matches):
    y = torch.randint(0, V, (T,))
    y[:12] = -100  # a whole sequence of a batch, say, plus a whole chunk
    _check(torch.float32, device, assert_matches, targets=y, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_targets_that_are_a_strided_view_are_read_as_their_values(schedule, device, assert_matches):
    """E.g. every other label of a longer row: the kernels index the targets as one contiguous row."""
    every_other = torch.randint(0, V, (2 * T,))
    every_other[::3] = -100
    _check(torch.float32, device, assert_matches, targets=every_other[::2], schedule=schedule)


def test_targets_in_the_first_and_last_vocabulary_slice_and_at_their_edges(device, assert_matches):
    cols = lce.slice_cols(T, V, 4, _chunk_mib(BUDGET_ROWS["vocab"], torch.float32))
    last = (V - 1) // cols * cols
    assert V // cols >= 2 and last < V - 1
    y = torch.tensor([0, cols - 1, cols, 2 * cols - 1, last - 1, last, V - 1] * 3 + [-100, V - 2])
    _check(torch.float32, device, assert_matches, targets=y, schedule="vocab", softcap=4.0, z_loss_weight=1e-2)


@pytest.mark.parametrize("dtype, blocks", [(torch.float32, (9, 49)), (torch.bfloat16, (8, 49))])
def test_tiles_at_test_sizes_split_both_rows_and_vocabulary_with_ragged_ends(dtype, blocks):
    size = torch.empty((), dtype=dtype).element_size()
    assert lce.tile_shape(T, V, size, _chunk_mib(BUDGET_ROWS["tiles"], dtype)) == blocks


@pytest.mark.parametrize("vocab, blocks", [(128256, (512, 64128)), (151936, (640, 50688))])
def test_tiles_at_llama_and_qwen_vocabularies_take_at_least_512_rows_within_64_mib(vocab, blocks, monkeypatch):
    monkeypatch.setattr(lce, "TILE_ROWS", 512)
    rows, cols = lce.tile_shape(16384, vocab, 2)
    assert (rows, cols) == blocks
    assert rows * (2 * cols + 12) <= 64 * 2**20


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_labels_ignored_gives_zero_loss_and_zero_gradients_not_nan(schedule, device):
    x, w, _, _ = _problem(torch.float32, device)
    loss = linear_cross_entropy(x, w, torch.full((T,), -100, device=device), schedule=schedule,
                                chunk_mib=_chunk_mib(BUDGET_ROWS[schedule], torch.float32))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_incoming_gradient_scales_the_precomputed_gradients(device, assert_matches):
    x, w, _, y = _problem(torch.float32, device)
    (3.5 * linear_cross_entropy(x, w, y)).backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    (3.5 * linear_cross_entropy_reference(xr, wr, y)).backward()
    assert_matches(x.grad, xr.grad, torch.float32)
    assert_matches(w.grad, wr.grad, torch.float32)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_without_grad_mode_only_the_loss_is_computed(schedule, device, assert_matches):
    x, w, _, y = _problem(torch.float32, device)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, y, schedule=schedule,
                                    chunk_mib=_chunk_mib(BUDGET_ROWS[schedule], torch.float32))
    assert loss.grad_fn is None
    assert_matches(loss, linear_cross_entropy_reference(x.detach(), w.detach(), y), torch.float32)


def test_causal_lm_loss_shifts_labels_like_hf(device, assert_matches):
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden = torch.randn(2, 7, H, device=device)
    w = 0.3 * torch.randn(V, H, device=device)
    labels = torch.randint(0, V, (2, 7), device=device)
    labels[1, :] = -100
    labels[0, 0] = -100
    expected = ForCausalLMLoss(F.linear(hidden, w), labels, vocab_size=V)
    assert_matches(causal_lm_loss(hidden, w, labels), expected, torch.float32)


def test_pre_shifted_labels_give_the_same_loss(device):
    hidden = torch.randn(2, 6, H, device=device)
    w = 0.3 * torch.randn(V, H, device=device)
    labels = torch.randint(0, V, (2, 6), device=device)
    torch.testing.assert_close(causal_lm_loss(hidden, w, None, shift_labels=causal_targets(labels)),
                               causal_lm_loss(hidden, w, labels))


def test_head_returns_logits_without_labels_and_the_loss_with_them(device, assert_matches):
    head = LinearCrossEntropyHead(H, V, bias=False).to(device)
    hidden = torch.randn(2, 5, H, device=device)
    labels = torch.randint(0, V, (2, 5), device=device)
    torch.testing.assert_close(head(hidden), F.linear(hidden, head.weight))
    expected = causal_lm_loss(hidden, head.weight.detach(), labels)
    assert_matches(head(hidden, labels=labels), expected, torch.float32)


def test_chunk_holds_at_most_63_mib_of_logits_at_llama3_and_qwen_vocab():
    for vocab in (128256, 151936):
        rows = lce.chunk_rows(16384, vocab, element_size=2)
        assert rows % 8 == 0 and rows * vocab * 2 <= 63 * 2**20


def test_vocabulary_slice_and_its_state_hold_at_most_63_mib():
    for tokens in (4096, 16384, 65536):
        cols = lce.slice_cols(tokens, 128256, element_size=2)
        assert cols % (128 if cols >= 1024 else 8) == 0
        assert tokens * (cols * 2 + 12) <= 63 * 2**20  # logits and the online log-sum-exp's state
    assert lce.slice_cols(16384, 128256, 2) == 1920 and lce.slice_cols(64, 128256, 2) == 128256


def test_unknown_schedule_is_refused(device):
    x, w, _, y = _problem(torch.float32, device)
    with pytest.raises(ValueError, match="schedule"):
        linear_cross_entropy(x, w, y, schedule="columns")


def test_backward_twice_is_refused(device):
    x, w, _, y = _problem(torch.float32, device)
    loss = linear_cross_entropy(x, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_without_interpreter_matches_reference(bias, schedule, monkeypatch, assert_matches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check(torch.float32, torch.device("cpu"), assert_matches, bias=bias, softcap=4.0, z_loss_weight=1e-2,
           schedule=schedule)
