"""``python -m gradstore.cli``: the command line."""

from gradstore.cli import app

app()
