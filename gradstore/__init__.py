"""gradstore: a gradient-store database for training data attribution.

>>> import gradstore
>>> store = gradstore.open("runs/store")   # creates the store if it does not exist
"""

import os

os.environ.setdefault("LANCE_LOG", "error")  # Lance logs a warning for every table it creates

from gradstore.errors import (GradstoreError, NonFiniteGradientError, NotAStoreError, SchemaMismatchError,  # noqa: E402
                              SQLError, StoreCorruptError, UnknownRunError, WriterClosedError)
from gradstore.store import GradientBlock, GradStore, open_store as open  # noqa: A001, E402
from gradstore.writer import GradientWriter, WriterConfig  # noqa: E402

__all__ = ["open", "GradStore", "GradientBlock", "GradientWriter", "WriterConfig", "GradstoreError",
           "NotAStoreError", "StoreCorruptError", "SchemaMismatchError", "NonFiniteGradientError",
           "UnknownRunError", "SQLError", "WriterClosedError"]
__version__ = "0.1.0"
