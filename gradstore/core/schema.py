"""Arrow schemas of the store's tables (see docs/store.md, "Tables").

The gradient table's vector column is created when the first run fixes the dimension; the ``examples``
table takes the user's own columns on the first ``add_examples``.
"""

from __future__ import annotations

import pyarrow as pa

from gradstore.core.vectors import EXPONENT_COLUMN as EXPONENT_COLUMN  # the row columns, named by their codec
from gradstore.core.vectors import NORM_COLUMN, VECTOR_COLUMN, exponent_field, vector_field
from ingest import CaptureLabels

FORMAT_KEY = b"gradstore.format"
FORMAT_VERSION = b"1"
#: The ``runs`` table's schema metadata key holding the store's storage dtype, written when the store is created
#: (the dtype is fixed then, before any run exists; stores made before it was recorded lack the key).
STORAGE_DTYPE_KEY = b"gradstore.storage_dtype"

RUNS = "runs"
CHECKPOINTS = "checkpoints"
GRADIENTS = "gradients"
EXAMPLES = "examples"
SCORES = "scores"
SELF_INFLUENCE = "self_influence"
SKIPPED_STEPS = "skipped_steps"

#: The checkpoint label of rows appended without one: capture's default, so rows written by hand and
#: captured rows are selected alike.
DEFAULT_CHECKPOINT: str = CaptureLabels.checkpoint


_TIMESTAMP = pa.timestamp("us", tz="UTC")


def _tagged(fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={FORMAT_KEY: FORMAT_VERSION})


RUNS_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("created_at", _TIMESTAMP),
        pa.field("model_fingerprint", pa.string()),
        pa.field("projection", pa.string()),  # the projection spec as JSON
        pa.field("projection_fingerprint", pa.string()),
        pa.field("dim", pa.int32()),
        pa.field("config", pa.string()),  # free-form JSON: capture config, user notes
    ]
)


def runs_schema_of_new_store(storage_dtype: str) -> pa.Schema:
    """:data:`RUNS_SCHEMA` with the storage dtype of the store it is created in (:data:`STORAGE_DTYPE_KEY`)."""
    return RUNS_SCHEMA.with_metadata({**RUNS_SCHEMA.metadata, STORAGE_DTYPE_KEY: storage_dtype.encode()})


CHECKPOINTS_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string(), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("epoch", pa.int32()),
        pa.field("learning_rate", pa.float64()),
        pa.field("created_at", _TIMESTAMP),
    ]
)

#: Metadata columns of the gradients table, in order (the vector columns follow).
GRADIENT_METADATA_FIELDS = [
    pa.field("grad_id", pa.int64(), nullable=False),
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("checkpoint", pa.string()),
    pa.field("step", pa.int64()),
    pa.field("epoch", pa.int32()),
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("example_hash", pa.string()),
    pa.field("split", pa.string()),
    pa.field("rank", pa.int32()),
    pa.field("loss", pa.float32()),
    pa.field("num_tokens", pa.int32()),
    pa.field("learning_rate", pa.float64()),
]
GRADIENT_METADATA_NAMES = [f.name for f in GRADIENT_METADATA_FIELDS]


def gradients_schema(dim: int, dtype: str, *, int8_blocks: bool = True) -> pa.Schema:
    """Schema of the gradients table for vectors of ``dim`` stored as ``dtype`` (int8: with the block exponents'
    column, unless ``int8_blocks=False``, the per-row format of tables made before it)."""
    blocked = [exponent_field(dim)] if dtype == "int8" and int8_blocks else []
    return _tagged(
        GRADIENT_METADATA_FIELDS
        + [
            vector_field(VECTOR_COLUMN, dim, dtype, int8_blocks=int8_blocks),
            pa.field(NORM_COLUMN, pa.float32(), nullable=False),
            *blocked,
        ]
    )


SCORES_SCHEMA = _tagged(
    [
        pa.field("query_id", pa.string()),
        pa.field("example_id", pa.string()),
        pa.field("grad_id", pa.int64()),
        pa.field("score", pa.float64()),
        pa.field("rank", pa.int32()),
        pa.field("method", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("checkpoint", pa.string()),
        pa.field("index_name", pa.string()),
        pa.field("call_id", pa.string()),  # one per attribute call (stores made before it hold nulls)
        pa.field("created_at", _TIMESTAMP),
    ]
)

SELF_INFLUENCE_SCHEMA = _tagged(
    [
        pa.field("example_id", pa.string()),
        pa.field("grad_id", pa.int64()),
        pa.field("run_id", pa.string()),
        pa.field("checkpoint", pa.string()),
        pa.field("method", pa.string()),
        pa.field("self_influence", pa.float64()),
        pa.field("created_at", _TIMESTAMP),
    ]
)

#: One row per captured training batch that was not written: its gradients held NaN/Inf (``nonfinite_gradient``)
#: or the GradScaler skipped its step (``grad_scaler_overflow``). Created by the first such batch; SQL shows an
#: empty view until then.
SKIPPED_STEPS_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("epoch", pa.int32()),
        pa.field("split", pa.string()),
        pa.field("rank", pa.int32()),
        pa.field("reason", pa.string()),
        pa.field("example_ids", pa.list_(pa.string())),
        pa.field("n_rows", pa.int32()),
        pa.field("n_nonfinite", pa.int32()),  # rows holding NaN/Inf (0: the scaler's overflow was elsewhere)
        pa.field("created_at", _TIMESTAMP),
    ]
)

ONLINE_SELECTION = "online_selection"

#: One row per example and optimizer step of online data selection (:mod:`gradstore.capture.online`): kept or dropped,
#: the weight applied, its score against the target and its loss (null when not computed).
ONLINE_SELECTION_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("rank", pa.int32()),
        pa.field("example_id", pa.string()),
        pa.field("kept", pa.bool_()),
        pa.field("weight", pa.float64()),  # 1 kept, 0 dropped, else the weight applied
        pa.field("score", pa.float64()),
        pa.field("loss", pa.float32()),
        pa.field("renormalization", pa.float64()),  # the factor the step's gradient was multiplied by
        pa.field("policy", pa.string()),
        pa.field("created_at", _TIMESTAMP),
    ]
)

COVERAGE = "capture_coverage"

#: One row per trainable parameter of the model of each capture (:mod:`ingest.coverage`): captured (``how``:
#: ``"hook"`` or ``"op"``, into ``slot``) or not and why. A run's coverage is that of its latest capture.
COVERAGE_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string()),
        pa.field("split", pa.string()),
        pa.field("rank", pa.int32()),
        pa.field("parameter", pa.string()),
        pa.field("numel", pa.int64()),
        pa.field("captured", pa.bool_()),
        pa.field("slot", pa.string()),
        pa.field("how", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("created_at", _TIMESTAMP),
    ]
)

OPTIMIZER_STEPS = "optimizer_steps"

#: One row per optimizer step of a capture with an optimizer (:mod:`gradstore.capture.optimizer_state`): the
#: hyper-parameters the step used and, for Adam, its frozen preconditioner ``1 / (sqrt(v_hat) + eps)`` in the
#: projected space (per coordinate where the layer is stored unprojected, else one value per layer). Stores made
#: before it lack the table: trajectory methods then model a step as ``lr x gradient``.
OPTIMIZER_STEPS_SCHEMA = _tagged(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("rank", pa.int32()),
        pa.field("optimizer", pa.string()),  # "sgd", "adam", "adamw", else the class name (modelled as lr x grad)
        pa.field("learning_rate", pa.float64()),
        pa.field("momentum", pa.float64()),  # SGD's momentum; Adam's beta1
        pa.field("dampening", pa.float64()),
        pa.field("nesterov", pa.bool_()),
        pa.field("weight_decay", pa.float64()),
        pa.field("beta2", pa.float64()),
        pa.field("eps", pa.float64()),
        pa.field("adam_step", pa.int64()),  # Adam's step count after the step (its bias corrections)
        pa.field("preconditioner", pa.list_(pa.float64())),  # [dim] per coordinate, or [layers] per layer
        # the capture's normalizer when the step's rows were captured in Adam's geometry ("adam_sqrt", ...): the
        # preconditioner is then in the rows already and the dynamics do not apply it again
        pa.field("rows_normalizer", pa.string()),
        # where parameter groups differ in weight decay: [dim] per coordinate, or [layers] (the weight's group)
        pa.field("weight_decays", pa.list_(pa.float64())),
        # where the optimizer's parameter groups differ: the hyper-parameters that do ("lr, weight_decay")
        pa.field("group_differences", pa.string()),
        # the gradients the step applied: "backward" (as the last backward left them), "unscaled" (divided by the
        # capture's GradScaler's scale only), "modified" (changed otherwise: clipped, rescaled), null: not checked
        pa.field("gradients", pa.string()),
        # JSON: each parameter group's trainable parameters by the model's names (null: a tensor that is no
        # parameter of the model), on the first step a capture records under a checkpoint and where the groups change
        pa.field("group_parameters", pa.string()),
        # JSON: each parameter group's hyper-parameters at the step ([{"lr": ..., ...}, ...])
        pa.field("group_hyperparameters", pa.string()),
        # JSON: where the captured parameters' groups differ in learning rate, [[weight's lr, bias's lr | null], ...]
        # per captured layer in the rows' order; null: every one at the row's learning_rate
        pa.field("learning_rates", pa.string()),
        # JSON: how the step weighted its captured training rows relative to their mean ({"total", "least", "most"}:
        # gradstore.capture.optimizer_state.StepWeights); null: no training rows captured, or an earlier version
        pa.field("row_weights", pa.string()),
        # JSON: the names of the optimizer's parameters that had no gradient at the step (it left them as they were)
        pa.field("without_gradients", pa.string()),
        # "empty" or "held": whether the optimizer held state (momentum, Adam's moments) before the first step a
        # capture records (a capture that starts mid-training: "held")
        pa.field("initial_state", pa.string()),
        # JSON: {name: [float64 sum, sum of squares]} of the model's parameters before the first step a capture records
        pa.field("initial_weights", pa.string()),
        pa.field("created_at", _TIMESTAMP),
    ]
)

#: Tables created on first use that SQL always shows (empty until then).
LAZY_SCHEMAS = {
    SKIPPED_STEPS: SKIPPED_STEPS_SCHEMA,
    ONLINE_SELECTION: ONLINE_SELECTION_SCHEMA,
    COVERAGE: COVERAGE_SCHEMA,
    OPTIMIZER_STEPS: OPTIMIZER_STEPS_SCHEMA,
}

FIXED_SCHEMAS = {
    RUNS: RUNS_SCHEMA,
    CHECKPOINTS: CHECKPOINTS_SCHEMA,
    SCORES: SCORES_SCHEMA,
    SELF_INFLUENCE: SELF_INFLUENCE_SCHEMA,
}
