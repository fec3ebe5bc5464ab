"""Chat records `{"messages": [{"role", "content"}, ...]}`, rendered with the tokenizer's own chat template.

The loss is taken on the assistant turns only: their contents and the end-of-turn token that closes each one
(as TRL and torchtune train it), so the tuned model learns to stop. Role headers, system and user turns get
label -100. Where the assistant turns lie in the rendered text is found in one of two ways:

- a template with `{% generation %}` markers says so itself: transformers' `apply_chat_template(...,
  return_assistant_tokens_mask=True)` returns the mask of the tokens rendered inside the markers;
- a template without markers (most published ones) is rendered prefix by prefix: the text of
  `messages[:i]` with the generation prompt (the assistant header) and that of `messages[:i + 1]` differ by
  exactly turn i's content, its end-of-turn token and the separator the template writes after it. The
  separator (whitespace, e.g. ChatML's newline) is left out, as generation markers leave it out.

The spans are character spans of one rendering, mapped to tokens by the tokenizer's offsets (a token that
overlaps a span is trained, as transformers does for markers). Tokenizing the prefixes apart and taking the
token difference would be wrong where a merge crosses the boundary between turns; characters are exact.
A template that renders earlier turns differently once later ones follow (e.g. one that drops the reasoning
of past turns) has no consistent prefixes: it is refused, to be given `{% generation %}` markers instead.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the pattern transformers looks for


def chat_record_problem(messages: Any) -> str | None:
    """What is wrong with a record's "messages" (None when nothing is), for an error that names its line."""
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role": ..., "content": ...} objects'
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            return f'messages[{i}] must be {{"role": one of {list(ROLES)}, "content": a string}}; it is {message!r}'
    if messages[0]["role"] == "assistant":
        return "the first message is the assistant's; a conversation starts with a system or user message"
    if all(message["role"] != "assistant" for message in messages):
        return "no message has the role 'assistant', so there is nothing to train on"
    return None


def encode_chat(messages: Messages, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> dict[str, list[int]]:
    """Tokens of one conversation as the chat template renders it, cut to `seq_len`, loss on assistant turns."""
    if not tokenizer.chat_template:
        raise ValueError('Chat records ({"messages": [...]}) are rendered with the tokenizer\'s chat template, and '
                         "this tokenizer has none: point model.pretrained at a folder whose tokenizer has a chat "
                         'template, or write {"prompt": ..., "response": ...} records instead.')
    if not tokenizer.is_fast:
        raise ValueError("Chat records need a fast tokenizer (its offsets locate the assistant turns); the one of "
                         "model.pretrained is not: save the folder with a tokenizer.json.")
    if GENERATION_MARKER.search(tokenizer.get_chat_template()):  # the default one where it has several
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = _masked_by_prefixes(messages, tokenizer)
    labels = [token if trained else IGNORE_INDEX for token, trained in zip(ids, mask)]
    return {"input_ids": ids[:seq_len], "attention_mask": [1] * len(ids[:seq_len]), "labels": labels[:seq_len]}


def _masked_by_prefixes(messages: Messages, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and 1 on the tokens of assistant turns, found by prefix renderings."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = [_assistant_span(messages, i, tokenizer, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start < span_end and end > span_start for span_start, span_end in spans))
            for start, end in encoding["offset_mapping"]]
    return encoding["input_ids"], mask


def _assistant_span(messages: Messages, i: int, tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, int]:
    """Characters of `text` (the whole rendering) that turn i, an assistant's, adds after its header."""
    before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
    through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
    if not (through.startswith(before) and text.startswith(through)):
        raise ValueError(f"The chat template of model.pretrained renders the turns before message {i} differently "
                         "once later turns follow, so the assistant turns cannot be told apart by rendering "
                         "prefixes. Give the template {% generation %} ... {% endgeneration %} markers around "
                         "the assistant content (the tokenizer's chat_template), or use "
                         '{"prompt": ..., "response": ...} records.')
    return len(before), max(len(before), len(through.rstrip()))
