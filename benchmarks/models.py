"""Model shapes, parameter counts and FLOP formulas, in plain Python (no torch).

Our own small table rather than `lightning_slide.models`, so that the benchmark measures the same
architectures even while the runtime's registry changes. Shapes are those of the published configs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-style decoder (all we need to build it and count its work)."""

    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block (attention, SwiGLU MLP, two RMSNorms)."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Embedding plus an untied head: what "N without embeddings" leaves out."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """Every trainable parameter (tied embedding counted once), as the optimizer sees them."""
        return self.layers * self.block_params + self.hidden + self.embedding_params

    @property
    def params_no_embedding(self) -> int:
        """N in the 6*N*T convention: decoder blocks and final norm, no embedding and no head."""
        return self.params - self.embedding_params


MODELS: dict[str, ModelSpec] = {
    "llama3_1b": ModelSpec("Llama-3.2-1B config", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "llama3_3b": ModelSpec("Llama-3.2-3B config", 3072, 28, 24, 8, 8192, 128256, tied=True),
    "llama3_8b": ModelSpec("Llama-3.1-8B config", 4096, 32, 32, 8, 14336, 128256, tied=False),
    # Small enough for a CPU end-to-end run of the harness (the smoke suite).
    "tiny": ModelSpec("tiny Llama (smoke test)", 64, 2, 4, 2, 128, 256, tied=False, rope_theta=10000.0),
}

FLOP_FORMULAS = {
    "6nt": "6*N*T, N without embedding and head",
    "full": "6*N*T + 6*hidden*vocab*T (head) + 12*layers*hidden*seq*T (attention, non-causal, PaLM)",
}


def step_flops(spec: ModelSpec, tokens: int, seq_len: int, formula: str, recompute: bool = False) -> float:
    """FLOPs of one training step over `tokens` tokens, by one of FLOP_FORMULAS.

    Reported TFLOP/s use recompute=False (model FLOPs: work done twice is not counted twice). The GPU
    bound uses recompute=True where blocks run their forward again in the backward: blocks then cost
    8*N*T instead of 6*N*T and attention 16 instead of 12 per token; the head is never recomputed.
    """
    passes = 8 if recompute else 6
    blocks = passes * spec.params_no_embedding * tokens
    if formula == "6nt":
        return float(blocks)
    head = 6 * spec.hidden * spec.vocab * tokens
    attention = 2 * passes * spec.layers * spec.hidden * seq_len * tokens
    return float(blocks + head + attention)
