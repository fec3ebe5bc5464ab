"""Fused linear cross-entropy: loss and gradients against full-logits PyTorch, chunk by chunk."""
import pytest
import torch
import torch.nn.functional as F

import ops.cross_entropy as lce
from ops import (LinearCrossEntropyHead, causal_lm_loss, causal_targets, linear_cross_entropy,
                 linear_cross_entropy_reference)

DTYPES = [torch.float32, torch.bfloat16]
T, H, V = 23, 16, 97  # odd sizes: 23 tokens in chunks of 5 leave a remainder of 3


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


def _check(dtype, device, assert_matches, bias=False, targets=None, **kwargs):
    """Run ours in chunks and the reference in fp32 on the same inputs; compare loss and grads."""
    x, w, b, y = _problem(dtype, device, bias)
    y = y if targets is None else targets.to(device)
    inputs = [t for t in (x, w, b) if t is not None]
    refs = [t.detach().float().requires_grad_() for t in inputs]

    loss = linear_cross_entropy(x, w, y, b, chunk_mib=_chunk_mib(5, dtype), **kwargs)
    expected = linear_cross_entropy_reference(*refs[:2], y, refs[2] if bias else None, **kwargs)
    assert loss.dtype == torch.float32
    assert_matches(loss, expected, dtype)
    loss.backward()
    expected.backward()
    for got, ref in zip(inputs, refs):
        assert_matches(got.grad, ref.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_and_gradients_match_reference_over_several_chunks(dtype, device, assert_matches):
    _check(dtype, device, assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_z_loss_match_reference(dtype, device, assert_matches):
    _check(dtype, device, assert_matches, softcap=4.0, z_loss_weight=1e-2)


def test_bias_gets_its_gradient(device, assert_matches):
    _check(torch.float32, device, assert_matches, bias=True)


def test_online_log_sum_exp_across_vocabulary_blocks(device, assert_matches, monkeypatch):
    monkeypatch.setattr(lce, "CE_BLOCK", 32)  # 97 columns -> 4 blocks, the last one masked
    _check(torch.float32, device, assert_matches, softcap=3.0)


def test_num_items_in_batch_divides_the_summed_loss(device, assert_matches):
    _check(torch.float32, device, assert_matches, num_items_in_batch=torch.tensor(40))


def test_rows_with_every_label_ignored_contribute_nothing(device, assert_matches):
    y = torch.randint(0, V, (T,))
    y[:12] = -100  # a whole sequence of a batch, say, plus a whole chunk
    _check(torch.float32, device, assert_matches, targets=y)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients_not_nan(device):
    x, w, _, _ = _problem(torch.float32, device)
    loss = linear_cross_entropy(x, w, torch.full((T,), -100, device=device))
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


def test_without_grad_mode_only_the_loss_is_computed(device, assert_matches):
    x, w, _, y = _problem(torch.float32, device)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, y)
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


def test_backward_twice_is_refused(device):
    x, w, _, y = _problem(torch.float32, device)
    loss = linear_cross_entropy(x, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_cpu_without_interpreter_matches_reference(monkeypatch, assert_matches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check(torch.float32, torch.device("cpu"), assert_matches, softcap=4.0, z_loss_weight=1e-2)
