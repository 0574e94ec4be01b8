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


def token_dataset(n: int, seq: int):
    """A ``datasets.Dataset`` of ``n`` seeded random token sequences of length ``seq`` (``input_ids``, ``labels``
    and ``example_id`` "ex0" ...) for the tiny GPT-2."""
    import datasets
    import torch

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (n, seq), generator=gen).tolist()
    return datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "example_id": [f"ex{i}" for i in range(n)]}
    )


def collate(features: list[dict]):
    """Stack ``input_ids`` and ``labels`` of dataset rows into tensors (the Trainer's collator)."""
    import torch

    return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "labels")}


def tiny_mlp():
    """A 6 -> 8 -> 3 MLP (Linear, Tanh, Linear) initialised from seed 0: the small classifier many tests capture."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
