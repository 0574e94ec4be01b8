"""Small models built in code (no downloads) shared by the tests."""

from __future__ import annotations


def tiny_gpt2(dropout: float = 0.0, attention: str | None = None):
    """A 2-layer GPT-2 (Conv1D + tied Embedding/LM head) with 32-dim embeddings and a 64-token vocabulary."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=32,
        vocab_size=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    if attention is not None:
        config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config)
