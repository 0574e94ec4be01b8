"""Text queries for ``gradstore serve --model module:factory``: a prompt and a completion typed by a person,
turned into a query gradient with the run's own projection and looked up like any other query.

The contract of ``factory()`` (called once, at start; the module importable from the current directory, as
``gradstore evaluate lds --train``): it returns ``(model, tokenizer, loss_fn)`` where

- ``model`` is the ``torch.nn.Module`` the run was captured on (in the state its query rows were captured at);
- ``tokenizer(prompt, completion)`` returns one batch (whatever ``loss_fn`` takes, e.g. a dict of tensors) of
  exactly one example: the prompt as context and the completion as the target;
- ``loss_fn(model, batch)`` returns the scalar loss whose gradient is the query (``None``: ``model(**batch).loss``).

The model comes only from the operator's ``--model`` at start, never from a request; requests give text only."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gradstore.errors import InvalidArgumentError


@dataclass
class TextModel:
    """The model, tokenizer and loss a server turns text queries into gradients with."""

    model: Any
    tokenizer: Any
    loss_fn: Any
    spec: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one backward at a time

    def batch(self, prompt: str, completion: str) -> Any:
        try:
            return self.tokenizer(prompt, completion)
        except (ValueError, KeyError, IndexError, TypeError) as error:  # text the tokenizer refuses
            raise InvalidArgumentError(f"the tokenizer refused this text: {error}") from error


def load_model(spec: str) -> TextModel:
    """``module:factory`` -> the :class:`TextModel` of ``factory()`` (the contract in the module docstring)."""
    import importlib
    import sys

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise InvalidArgumentError(f"--model must be module:factory, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise InvalidArgumentError(f"--model {spec!r} cannot be imported: {error}") from error
    made = factory()
    if not isinstance(made, tuple) or len(made) != 3:
        raise InvalidArgumentError(f"--model {spec!r}: factory() must return (model, tokenizer, loss_fn)")
    model, tokenizer, loss_fn = made
    if not callable(tokenizer):
        raise InvalidArgumentError(f"--model {spec!r}: the tokenizer must be callable as tokenizer(prompt, completion)")
    return TextModel(model, tokenizer, loss_fn, spec)
