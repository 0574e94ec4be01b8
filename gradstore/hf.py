"""Hugging Face ``Trainer`` (and TRL ``SFTTrainer``) integration: capture during ``trainer.train()``.

>>> from gradstore.hf import GradstoreCallback, with_example_ids
>>> trainer = Trainer(model, args=TrainingArguments(..., remove_unused_columns=False),
...                   train_dataset=ds, data_collator=with_example_ids(collator),
...                   callbacks=[GradstoreCallback(store, run="sft-1")])
>>> trainer.train()

**Example ids.** The ``Trainer`` drops every dataset column its model's ``forward`` does not name when
``remove_unused_columns=True`` (the default), and ``example_id`` is such a column. Keep it with
``remove_unused_columns=False`` and wrap the collator with :func:`with_example_ids`, which takes the
column out of the features before the real collator sees them and hands the ids to the model as an
``example_id`` batch entry; capture removes it before the model runs. Without ids, rows are identified by
a content hash of their tokens (``example_hash``).

transformers is an optional dependency (``pip install gradstore[hf]``): only this module imports it.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradstore.distributed import distributed_capture, is_distributed
from gradstore.errors import CaptureUsageError
from ingest.capture import ProjectionConfig
from ingest.layers import select_layers

if TYPE_CHECKING:
    from gradstore.capture.session import StoreCapture
    from gradstore.store import GradStore

ID_ENTRY = "example_id"


def with_example_ids(
    collator: Callable[[list[dict[str, Any]]], Mapping[str, Any]], id_column: str = "example_id"
) -> Callable[[list[dict[str, Any]]], Mapping[str, Any]]:
    """Wrap a data collator so each batch carries its examples' ids (from dataset column ``id_column``)
    as an ``example_id`` entry, which capture consumes before the model sees the batch.

    Needs ``remove_unused_columns=False`` in the training arguments (otherwise the ``Trainer`` removed
    the column before the collator runs).
    """

    def collate(features: list[dict[str, Any]]) -> Mapping[str, Any]:
        if features and id_column not in features[0]:
            raise KeyError(
                f"the batch has no {id_column!r} column: the Trainer drops dataset columns that the model's "
                "forward does not accept when remove_unused_columns=True (the default). Pass "
                "remove_unused_columns=False in TrainingArguments/SFTConfig."
            )
        ids = [str(f[id_column]) for f in features]
        batch = collator([{k: v for k, v in f.items() if k != id_column} for f in features])
        batch[ID_ENTRY] = ids
        return batch

    return collate


class GradstoreCallback(TrainerCallback):
    """Captures per-example gradients of every training step of a ``Trainer`` into ``store`` run ``run``.

    * ``on_train_begin``: starts capture on the trainer's model (under ``torch.distributed`` with more than
      one rank, a :func:`gradstore.distributed.distributed_capture` whose ranks commit together every
      ``commit_every`` optimizer steps and at every save).
    * steps, epochs and learning rates come from the trainer: ``step`` = ``state.global_step`` before the
      update (all micro-batches of a gradient accumulation share it), ``epoch`` = the epoch index, the
      learning rate = the one the optimizer applies in that update (after the scheduler).
    * ``on_save``: flushes every row (committed before the checkpoint is done) and records the checkpoint
      ``checkpoint-<step>`` in the store's ``checkpoints`` table.
    * ``on_train_end``: flushes and closes the capture.

    ``options`` are the flat options of :meth:`ingest.CaptureConfig.from_options`. Defaults fit Hugging Face causal LMs:
    ``loss_reduction="token_mean"`` (the Trainer passes ``num_items_in_batch``, so gradient accumulation is
    undone) and, with ``average_tokens_across_devices`` on several ranks, ``loss_scale=world_size`` (the
    Trainer multiplies the loss by it). ``per_example_loss`` fills the ``loss`` column
    (e.g. :func:`ingest.losses.causal_lm_loss`). With ``fp16=True`` the Trainer's ``GradScaler`` (Accelerate's
    ``accelerator.scaler``, which its prepared optimizer carries) is found and passed as ``grad_scaler``: rows
    are unscaled and the batches of steps the scaler skips are listed in ``skipped_steps`` instead of written
    (pass ``grad_scaler=...`` to choose another). TRL's fused LM head divides by the Trainer's token count without
    passing it to the model: with gradient accumulation or ``average_tokens_across_devices`` on several ranks the
    callback takes it from the calling Trainer's ``compute_loss`` (rows stay exact).
    """

    def __init__(
        self,
        store: GradStore,
        run: str,
        *,
        commit_every: int = 100,
        per_example_loss: Callable[..., torch.Tensor] | None = None,
        writer: Any = None,
        **options: Any,
    ) -> None:
        self.store = store
        self.run = run
        self.commit_every = commit_every
        self.per_example_loss = per_example_loss
        self.writer = writer
        self.options = options
        self.capture: StoreCapture | None = None
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start capturing the trainer's model."""
        if model is None:
            raise CaptureUsageError("GradstoreCallback: the trainer passed no model to on_train_begin")
        if self.capture is not None:
            self.close()
        options = {"loss_reduction": "token_mean", **self.options, **_skip_fused_lm_head(model, self.options)}
        trainer = _trainer_for_fused_lm_head(model, args)
        if "loss_scale" not in options and is_distributed() and getattr(args, "average_tokens_across_devices", False):
            options["loss_scale"] = float(torch.distributed.get_world_size())
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        common = {"optimizer": inner, "per_example_loss": self.per_example_loss, "writer": self.writer}
        if "grad_scaler" not in options:
            common["grad_scaler"] = trainer_grad_scaler(optimizer)
        if is_distributed():
            cap = distributed_capture(self.store, model, self.run, commit_every=self.commit_every, **common, **options)
        else:
            cap = self.store.capture(model, self.run, **common, **options)
        self.capture = cap.__enter__()
        if trainer is not None:
            self._undo = _pass_token_count_to_capture(trainer, model)
        self.capture.set_step(state.global_step)
        self.capture.set_epoch(_epoch_index(state))

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Record the new epoch index on the following rows."""
        if self.capture is not None:
            self.capture.set_epoch(_epoch_index(state))

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Rows of this step's micro-batches carry ``state.global_step``."""
        if self.capture is not None:
            self.capture.set_step(state.global_step)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Commit every captured row and record the saved checkpoint."""
        if self.capture is None:
            return
        self.capture.flush()
        if state.is_world_process_zero:
            lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
            self.store.record_checkpoint(
                self.run,
                f"checkpoint-{state.global_step}",
                step=state.global_step,
                epoch=_epoch_index(state),
                learning_rate=lr,
            )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Flush and close the capture."""
        self.close()

    def close(self) -> None:
        """Stop capturing (commits every row). Called at the end of training; call it yourself if
        ``trainer.train()`` raised, to remove the hooks."""
        cap, self.capture = self.capture, None
        undo, self._undo = self._undo, []
        for step in undo:
            step()
        if cap is not None:
            cap.__exit__(None, None, None)


def trainer_grad_scaler(optimizer: Any) -> Any | None:
    """The ``GradScaler`` of a Trainer's fp16 training: Accelerate's ``accelerator.scaler``, which the optimizer
    it prepared (what the Trainer hands to callbacks) holds as ``.scaler``; ``None`` without one (fp32, bf16, or
    a DeepSpeed engine that scales the loss itself)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not callable(getattr(scaler, "scale", None)) or not hasattr(scaler, "get_scale"):
        return None
    return scaler


def _trainer_for_fused_lm_head(model: torch.nn.Module, args: TrainingArguments) -> Any | None:
    """TRL's fused LM head divides the summed token loss by the Trainer's ``num_items_in_batch`` without passing it
    to the model, so capture would recount the label tokens of each micro-batch. That is the Trainer's count only
    with one micro-batch per step and, on several ranks, without ``average_tokens_across_devices`` (which sums the
    count over ranks and multiplies the loss by the world size). Otherwise the count must reach capture: return
    the ``Trainer`` calling this callback (found on the call stack), whose ``compute_loss`` receives it, or
    refuse when there is none."""
    if not _accepts_fused_lm_head(model.forward):
        return None
    accumulation = args.gradient_accumulation_steps > 1
    across_ranks = is_distributed() and getattr(args, "average_tokens_across_devices", False)
    if not (accumulation or across_ranks):
        return None
    trainer = _calling_trainer()
    if trainer is None:
        reasons = " and ".join(
            part
            for part, on in (
                (f"gradient_accumulation_steps={args.gradient_accumulation_steps}", accumulation),
                ("average_tokens_across_devices=True on several ranks", across_ranks),
            )
            if on
        )
        raise CaptureUsageError(
            f"GradstoreCallback: TRL's fused LM head divides the loss by a token count over all micro-batches "
            f"(and ranks) that it never passes to the model, and no Trainer calling this callback was found to "
            f"take it from, so per-example rows cannot be scaled exactly with {reasons}. Run the callback from "
            f"trainer.train(), or set gradient_accumulation_steps=1 (raise per_device_train_batch_size instead) "
            f"and, on several ranks, average_tokens_across_devices=False (see docs/integrations.md)."
        )
    return trainer


def _calling_trainer() -> Any | None:
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _pass_token_count_to_capture(trainer: Any, model: torch.nn.Module) -> list[Callable[[], None]]:
    """Hand the Trainer's ``num_items_in_batch`` to capture's scaling for TRL's fused-LM-head forwards: the
    trainer's ``compute_loss`` is wrapped to remember it, a forward pre-hook that runs before capture's adds it to
    the forward's kwargs, and one that runs after capture's removes it again (the model never sees it).
    Returns the steps that undo this."""
    count: dict[str, Any] = {"n": None, "added": False}
    original = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, *args: Any, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled() and trainer.model.training  # evaluation never captures
        if num_items_in_batch is None and trainer.args.gradient_accumulation_steps > 1 and training:
            raise CaptureUsageError(
                "GradstoreCallback: the Trainer counted no label tokens (num_items_in_batch=None) under gradient "
                "accumulation with TRL's fused LM head, so rows cannot be scaled exactly: give the batches a "
                "`labels` entry, or set gradient_accumulation_steps=1."
            )
        count["n"] = num_items_in_batch
        try:
            return original(model, inputs, *args, num_items_in_batch=num_items_in_batch, **kwargs)
        finally:
            count["n"] = None

    def add(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        count["added"] = False
        if count["n"] is None or not kwargs.get("fused_lm_head") or "num_items_in_batch" in kwargs:
            return None
        count["added"] = True
        return args, {**kwargs, "num_items_in_batch": count["n"]}

    def remove(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not count["added"]:
            return None
        count["added"] = False
        return args, {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}

    trainer.compute_loss = compute_loss
    handles = [
        model.register_forward_pre_hook(add, with_kwargs=True, prepend=True),
        model.register_forward_pre_hook(remove, with_kwargs=True),
    ]

    def restore() -> None:
        for handle in handles:
            handle.remove()
        if trainer.__dict__.get("compute_loss") is compute_loss:
            del trainer.compute_loss

    return [restore]


def _skip_fused_lm_head(model: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """TRL's SFTTrainer patches ``model.forward`` with a fused LM head that multiplies by ``lm_head.weight``
    inside its own autograd function, so the ``lm_head`` module never runs and its hooks see nothing: its
    block of every row would be silently zero. Exclude it (the result of this function is merged into the
    capture options), or refuse when the user's own layer selection keeps it."""
    if not _accepts_fused_lm_head(model.forward):
        return {}
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None:
        return {}
    if "include" in options or "exclude" in options:
        layers = select_layers(
            model,
            tuple(options.get("layer_types", ProjectionConfig.layer_types)),
            options.get("include"),
            options.get("exclude"),
            bool(options.get("include_frozen", False)),
        )
        if any(info.name == name for info in layers):
            raise CaptureUsageError(
                f"{name!r} is computed by TRL's fused LM head, which bypasses the module: its gradient "
                f"cannot be captured. Exclude it (exclude='^{re.escape(name)}$')."
            )
        return {}
    return {"exclude": f"^{re.escape(name)}$"}


def _accepts_fused_lm_head(forward: Callable[..., Any]) -> bool:
    # TRL keeps the original signature on its wrapper, and accelerate wraps it again: walk the chain
    while forward is not None:
        try:
            if "fused_lm_head" in inspect.signature(forward, follow_wrapped=False).parameters:
                return True
        except (TypeError, ValueError):
            return False
        forward = getattr(forward, "__wrapped__", None)
    return False


def _epoch_index(state: TrainerState) -> int:
    # state.epoch is fractional during an epoch and exactly the epoch's index at its start
    return math.floor((state.epoch or 0.0) + 1e-9)
