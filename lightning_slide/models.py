"""Named model architectures and one way to build them: random init from a config, or a local HF folder.

The shapes below are those of the published `config.json` files, so `model=llama3_8b` trains the real
architecture (random weights) without a download; real weights come only from a local folder.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.utils import GENERATION_CONFIG_NAME

from lightning_slide.materialize import has_weights, meta_parameters, missing_weights


def _llama3_rope(factor: float) -> dict:
    """Llama 3.1/3.2 rope scaling ("llama3" type) as their config.json files write it."""
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _llama3(hidden: int, layers: int, heads: int, intermediate: int, tied: bool, rope_factor: float) -> dict:
    return dict(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=hidden // heads,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_llama3_rope(rope_factor),
        tie_word_embeddings=tied,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
    )


def _qwen3(hidden: int, layers: int, heads: int, intermediate: int) -> dict:
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    )


def _mistral(vocab: int, hidden: int, layers: int, intermediate: int, rope_theta: float,
             sliding_window: int | None) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )


#: name -> (HF config class, config kwargs). `tiny` is the CPU demo: a Llama small enough to learn
#: visibly in a minute on two cores, with the vocabulary of the built-in byte-level tokenizer.
MODELS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "tiny": (
        LlamaConfig,
        dict(
            vocab_size=264,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "llama3_1b": (LlamaConfig, _llama3(2048, 16, 32, 8192, tied=True, rope_factor=32.0)),
    "llama3_3b": (LlamaConfig, _llama3(3072, 28, 24, 8192, tied=True, rope_factor=32.0)),
    "llama3_8b": (LlamaConfig, _llama3(4096, 32, 32, 14336, tied=False, rope_factor=8.0)),
    "qwen2_5_7b": (
        Qwen2Config,
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151643,
            dtype="bfloat16",
        ),
    ),
    "qwen3_8b": (Qwen3Config, _qwen3(4096, 36, 32, 12288)),
    "qwen3_14b": (Qwen3Config, _qwen3(5120, 40, 40, 17408)),
    "mistral_7b": (MistralConfig, _mistral(32000, 4096, 32, 14336, rope_theta=10000.0, sliding_window=4096)),
    "mistral_small_24b": (  # Mistral-Small-24B-Base-2501
        MistralConfig, _mistral(131072, 5120, 40, 32768, rope_theta=100000000.0, sliding_window=None)),
}


def model_config(name: str, **overrides: object) -> PretrainedConfig:
    """The HF config of a named architecture; `overrides` change single fields (e.g. fewer layers)."""
    if name not in MODELS:
        raise KeyError(f"Unknown model {name!r}. Available models: {', '.join(sorted(MODELS))} "
                       "(or pass model.pretrained=/path/to/a/local/hf/folder).")
    config_class, kwargs = MODELS[name]
    return config_class(**{**kwargs, **overrides})


def load_config(name: str, pretrained: str | Path | None = None) -> PretrainedConfig:
    """The HF config of a run: the local folder's (checked to hold weights too) or the named architecture's."""
    if pretrained is None:
        return model_config(name)
    return AutoConfig.from_pretrained(_checkpoint_folder(pretrained), local_files_only=True)


def scale_rope(config: PretrainedConfig, scaling: Mapping[str, object]) -> PretrainedConfig:
    """A copy of `config` with its RoPE parameters updated from `scaling` and its positions
    (max_position_embeddings) grown by the ratio of the new RoPE factor to the old one (1 without one).

    `{"factor": 64.0}` takes Llama-3.2-3B (llama3 scaling, factor 32, 131,072 positions) to 262,144 positions;
    a model without scaling needs a type too, e.g. `{"rope_type": "linear", "factor": 2.0}` (or "yarn" and its
    parameters, as Hugging Face defines them)."""
    old = dict(getattr(config, "rope_parameters", None) or {})
    new = {**old, **scaling}
    config = copy.deepcopy(config)
    config.rope_parameters = new
    ratio = float(new.get("factor", 1.0)) / float(old.get("factor", 1.0))
    config.max_position_embeddings = int(config.max_position_embeddings * ratio)
    return config


def check_context(config: PretrainedConfig, seq_len: int, label: str) -> None:
    """ValueError when `seq_len` passes the model's positions (max_position_embeddings), naming rope scaling."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or seq_len <= limit:
        return
    rope = dict(getattr(config, "rope_parameters", None) or {})
    factor = float(rope.get("factor", 1.0)) * seq_len / limit
    factor = math.ceil(factor * 10) / 10  # one decimal, rounded up: enough positions
    example = f"{{factor:{factor:.1f}}}" if "factor" in rope else f"{{rope_type:linear,factor:{factor:.1f}}}"
    raise ValueError(f"data.seq_len={seq_len} exceeds {label}'s max_position_embeddings={limit}; set "
                     f"model.rope_scaling to stretch its positions (e.g. model.rope_scaling={example}), or a "
                     "shorter data.seq_len.")


def build_model(
    name_or_config: str | PretrainedConfig,
    pretrained: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    meta: bool = False,
) -> PreTrainedModel:
    """A causal LM with fp32 weights on the CPU (the runtime keeps its master copy there).

    `pretrained` (a local folder written by `save_pretrained`: safetensors or `pytorch_model.bin`) wins over
    the name: its config and weights are loaded without touching the network (a config given instead of a
    name replaces the folder's, e.g. with scaled RoPE); a folder without weights is refused. Otherwise the
    named (or given) config gets random weights.
    `meta=True` (for the slideformer strategy) builds placeholders instead, which its engine fills unit by
    unit from that folder or with random init, straight into its flat storage (see `materialize.py`).
    Either way the model comes back in train mode, ready to fine-tune (`from_pretrained` returns eval mode).
    """
    folder = None if pretrained is None else _checkpoint_folder(pretrained)
    given = name_or_config if isinstance(name_or_config, PretrainedConfig) else None
    if folder is not None and not meta:
        return AutoModelForCausalLM.from_pretrained(folder, config=given, dtype=dtype, local_files_only=True).train()
    if folder is not None:
        config = given or AutoConfig.from_pretrained(folder, local_files_only=True)
    else:
        config = given or model_config(name_or_config)
    declared = config.dtype  # the checkpoint's own dtype (bf16 when published): from_config overwrites it
    with meta_parameters() if meta else nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.dtype = declared or model.config.dtype
    if folder is not None:
        model.config.name_or_path = str(folder)
        if (folder / GENERATION_CONFIG_NAME).is_file():  # as from_pretrained reads it: stop ids, sampling
            model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return model.train()


def _checkpoint_folder(pretrained: str | Path) -> Path:
    """The folder, once it is known to hold a config and weights (either path would otherwise start from
    random weights without a word: the meta path fills placeholders with the initialiser, and a model
    built from the config alone is random too)."""
    folder = Path(pretrained).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.pretrained={str(pretrained)!r} is not a local Hugging Face model folder "
                                "(no config.json there). Point it at a folder written by save_pretrained, "
                                "or drop model.pretrained to train the named architecture from scratch.")
    if not has_weights(folder):
        raise missing_weights(folder, "model.pretrained", "Copy the weights into the folder, or drop "
                              "model.pretrained to train the named architecture from random weights.")
    return folder
