"""A tiny GPT in plain PyTorch (no transformers needed) and a word-level tokenizer for the demo corpus."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

PAD, UNKNOWN = "<pad>", "<unk>"


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary; id 0 is padding."""

    def __init__(self, texts: list[str]) -> None:
        words = sorted({word for text in texts for word in text.split()})
        self.vocab = [PAD, UNKNOWN, *words]
        self.index = {word: i for i, word in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.index.get(word, 1) for word in text.split()]

    def batch(self, texts: list[str], targets: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding; with ``targets``
        given, -100 everywhere except on each text's target word)."""
        encoded = [self.encode(text) for text in texts]
        length = max(len(ids) for ids in encoded)
        input_ids = torch.zeros(len(texts), length, dtype=torch.long)
        mask = torch.zeros(len(texts), length, dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(mask == 0, -100)
        if targets is not None:
            target_ids = torch.tensor([self.index[word] for word in targets])[:, None]
            labels = labels.masked_fill(input_ids != target_ids, -100)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@dataclass
class CausalLMOutput:
    """What the model returns: the mean token loss (when labels are given) and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, all projections ``nn.Linear``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal if attention_mask is None else causal & attention_mask[:, None, None, :].bool()
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """A small decoder-only language model: ``model(input_ids, attention_mask, labels).loss``."""

    def __init__(self, vocab_size: int, width: int = 64, layers: int = 2, heads: int = 4, max_length: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(max_length, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.position, std=0.02 / math.sqrt(2))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> CausalLMOutput:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x, attention_mask)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutput(loss, logits)
