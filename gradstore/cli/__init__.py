"""The ``gradstore`` command line: ``gradstore --help``.

One module per kind of command: :mod:`~gradstore.cli.store_commands` (info, sql, compact, verify, row-files,
report), :mod:`~gradstore.cli.scoring` (build-index, attribute, select, self-influence),
:mod:`~gradstore.cli.evaluation` (evaluate lds/qld), :mod:`~gradstore.cli.service` (demo, serve); importing the
package registers them all on :data:`app`."""

from __future__ import annotations

from gradstore.cli import evaluation, scoring, service, store_commands  # noqa: F401 (importing registers the commands)
from gradstore.cli.common import (
    NOT_ON_THE_COMMAND_LINE,
    SCORING_COMMANDS,
    AttributeMethod,
    BuildIndexMethod,
    SelectSpace,
    SelfInfluenceMethod,
    app,
)

__all__ = [
    "NOT_ON_THE_COMMAND_LINE",
    "SCORING_COMMANDS",
    "AttributeMethod",
    "BuildIndexMethod",
    "SelectSpace",
    "SelfInfluenceMethod",
    "app",
]
