"""Online data selection in a Hugging Face ``Trainer``: :class:`OnlineSelectionCallback` captures like
:class:`~gradstore.hf.GradstoreCallback` and, at every optimizer step, drops or reweights examples before the step
(:mod:`gradstore.capture.online`), recording the decisions in the store's ``online_selection`` table.

>>> callback = OnlineSelectionCallback(store, "sft-1", KeepTopFraction(0.5), target=query_target(store, "sft-1"))
>>> Trainer(model, args=TrainingArguments(..., max_grad_norm=0, remove_unused_columns=False),
...         data_collator=with_example_ids(collator), callbacks=[callback]).train()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from gradstore.capture.online import OnlineSelection, SelectionPolicy, Target, select_online
from gradstore.distributed import is_distributed
from gradstore.errors import InvalidArgumentError
from gradstore.hf import GradstoreCallback

if TYPE_CHECKING:
    from gradstore.store import GradStore


class OnlineSelectionCallback(GradstoreCallback):
    """A :class:`~gradstore.hf.GradstoreCallback` that also selects online: ``policy``, ``target``,
    ``similarity``, ``renormalize``, ``seed`` and ``selection_commit_every`` as in
    :func:`gradstore.capture.online.select_online`; the other arguments as in ``GradstoreCallback``.

    The Trainer clips gradients before its optimizer step, after which a removal would no longer be exact: training
    arguments with ``max_grad_norm > 0`` are refused (pass ``max_grad_norm=0``). With the callback's default
    ``loss_reduction="token_mean"`` a renormalised step is the Trainer's step on the kept examples' tokens only (the
    mean over them). One process only for now (several ranks are refused). The model's trainable parameters must all
    be Linear, Embedding or Conv1D weights (freeze LayerNorms, or train LoRA adapters)."""

    def __init__(
        self,
        store: GradStore,
        run: str,
        policy: SelectionPolicy,
        target: Target = None,
        *,
        similarity: str = "dot",
        renormalize: bool = True,
        seed: int = 0,
        selection_commit_every: int = 50,
        **kwargs: Any,
    ) -> None:
        super().__init__(store, run, **kwargs)
        self.policy = policy
        self.target = target
        self.selection_options = {
            "similarity": similarity,
            "renormalize": renormalize,
            "seed": seed,
            "commit_every": selection_commit_every,
        }
        self.selection: OnlineSelection | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start capturing and selecting."""
        if args.max_grad_norm is not None and args.max_grad_norm > 0:
            raise InvalidArgumentError(
                f"online selection removes examples' terms from the gradient before the optimizer step, but the "
                f"Trainer clips the gradient (max_grad_norm={args.max_grad_norm}) before that: pass "
                "max_grad_norm=0 in TrainingArguments"
            )
        if is_distributed():
            raise InvalidArgumentError(
                "OnlineSelectionCallback runs on one process only for now: train without torchrun/accelerate launch, "
                "or capture with GradstoreCallback and select offline (store.select)"
            )
        super().on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        try:
            self.selection = select_online(self.capture, self.policy, self.target, **self.selection_options)
            self.selection.__enter__()
        except BaseException:
            super().close()
            raise

    def close(self) -> None:
        """Stop selecting (commits the decisions) and capturing."""
        selection, self.selection = self.selection, None
        try:
            if selection is not None:
                selection.__exit__(None, None, None)
        finally:
            super().close()
