"""The demo's model for ``gradstore serve gradstore-demo --model gradstore.demo:serve_factory``.

``gradstore demo`` saves the trained TinyGPT's final weights and vocabulary next to the store's tables
(``demo-model.pt``: tensors, strings and integers only, read with ``torch.load(weights_only=True)``, so reading it
executes no code). :func:`serve_factory` rebuilds the model from that file; the store directory is
``$GRADSTORE_DEMO_STORE`` or ``./gradstore-demo``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gradstore.demo.model import TinyGPT, WordTokenizer

MODEL_FILE = "demo-model.pt"


def save_model(store_dir: str | Path, model: TinyGPT, tokenizer: WordTokenizer, width: int, layers: int) -> Path:
    """Write the final weights and vocabulary of the demo into the store directory."""
    path = Path(store_dir) / MODEL_FILE
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    torch.save({"state_dict": state, "vocab": list(tokenizer.vocab), "width": width, "layers": layers}, path)
    return path


def serve_factory(store_dir: str | Path | None = None) -> tuple[TinyGPT, Any, Any]:
    """``(model, tokenizer, loss_fn)`` of the demo: ``tokenizer(prompt, completion)`` scores the completion's
    words only (as the demo's queries are scored on their value word); ``loss_fn`` is the model's token-mean loss."""
    store_dir = Path(store_dir or os.environ.get("GRADSTORE_DEMO_STORE", "gradstore-demo"))
    saved = torch.load(store_dir / MODEL_FILE, weights_only=True)
    words = WordTokenizer([])
    words.vocab = list(saved["vocab"])
    words.index = {word: i for i, word in enumerate(words.vocab)}
    model = TinyGPT(len(words.vocab), width=int(saved["width"]), layers=int(saved["layers"]))
    model.load_state_dict(saved["state_dict"])
    model.eval()
    limit = model.position.shape[0]

    def tokenizer(prompt: str, completion: str) -> dict[str, torch.Tensor]:
        context, target = words.encode(prompt), words.encode(completion)
        if not context + target or len(context + target) > limit:
            raise ValueError(f"the demo model reads 1 to {limit} words, got {len(context + target)}")
        ids = torch.tensor([context + target])
        labels = ids.clone()
        if target:
            labels[0, : len(context)] = -100  # score the completion only
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    return model, tokenizer, None
