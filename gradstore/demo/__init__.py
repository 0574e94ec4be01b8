"""The embedded demo: a synthetic fact corpus, a tiny GPT, and the whole attribution job (``gradstore demo``)."""

from gradstore.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
