"""The embedded demo: a synthetic fact corpus, a tiny GPT, and the whole attribution job (``gradstore demo``)."""

from gradstore.demo.run import DemoConfig, run_demo
from gradstore.demo.serve import serve_factory

__all__ = ["DemoConfig", "run_demo", "serve_factory"]
