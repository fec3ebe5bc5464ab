"""Building a random-weight HF Llama fast, and the random token data (worker side: imports torch).

Materialising an 8B fp32 model with torch's CPU `normal_` takes most of a minute (one thread), so the
model is built on the meta device, given empty storage where it will live, and filled with normal
noise drawn on the GPU when there is one (in chunks, so a VRAM cap is never approached).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from benchmarks.models import ModelSpec

INIT_STD = 0.02
_CHUNK = 1 << 26  # elements drawn per GPU call when filling host tensors (256 MiB of fp32)


POSITIONS = 131072  # the positions Llama 3.1/3.2 configs declare (max_position_embeddings)


def hf_config(spec: ModelSpec, seq_len: int) -> LlamaConfig:
    """The HF config of a spec: SDPA attention, no KV cache, POSITIONS positions; a longer seq_len gets as many,
    with RoPE stretched linearly by seq_len / POSITIONS (position interpolation), as training past a model's
    declared context must."""
    stretch = seq_len / POSITIONS
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta} if stretch <= 1 else {
        "rope_type": "linear", "factor": stretch, "rope_theta": spec.rope_theta}
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=max(POSITIONS, seq_len),
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=spec.tied,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(spec: ModelSpec, seq_len: int, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A LlamaForCausalLM with N(0, 0.02) weights (RMSNorm weights 1) in `dtype` on `device`."""
    config = hf_config(spec, seq_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            fill_normal_(param.data)
    # to_empty left the non-persistent rotary buffer uninitialised: rebuild it (fp32, as HF keeps it).
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    if spec.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.train()
    return model


def fill_normal_(tensor: torch.Tensor) -> None:
    """Normal noise in place; host tensors get it drawn on the GPU (fast) and copied over."""
    if tensor.device.type != "cpu" or not torch.cuda.is_available():
        tensor.normal_(0.0, INIT_STD)
        return
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        part.copy_(torch.empty(part.shape, device="cuda", dtype=part.dtype).normal_(0.0, INIT_STD))


def random_tokens(spec: ModelSpec, rows: int, seq_len: int, seed: int = 0, zipf: float | None = None) -> torch.Tensor:
    """rows x seq_len token ids from a fixed seed (no padding): uniform over the vocabulary, or with `zipf`, the
    k-th most frequent id drawn with a probability proportional to 1 / k ** zipf, the ranks shuffled over the
    ids (text's skew: at 65,536 tokens of Llama-3's 128,256 ids, exponent 1 touches about 15% of them, uniform
    ids about 40%)."""
    generator = torch.Generator().manual_seed(seed)
    if zipf is None:
        return torch.randint(0, spec.vocab, (rows, seq_len), generator=generator)
    weights = torch.arange(1, spec.vocab + 1, dtype=torch.float64).pow_(-zipf)
    ranks = torch.multinomial(weights, rows * seq_len, replacement=True, generator=generator)
    return torch.randperm(spec.vocab, generator=generator)[ranks].view(rows, seq_len)
