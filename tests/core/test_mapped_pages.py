"""Row files' pages mapped in one call (gradstore.core.mapped_pages): the data is untouched and the system either
maps the pages or says it cannot."""

import os
import re
import sys

import torch

from gradstore.core import mapped_pages
from gradstore.core.mapped_pages import populate, tensors_in


def supported() -> bool:
    """Linux 5.14 or later (MADV_POPULATE_READ)."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (5, 14)


def test_populating_a_mapped_file_leaves_its_tensors_as_saved(tmp_path):
    saved = {"blocks": [{"rows": torch.randn(300, 77), "ids": torch.arange(300)}], "kernel": "float32"}
    torch.save(saved, tmp_path / "rows.pt")
    loaded = torch.load(tmp_path / "rows.pt", mmap=True, weights_only=True)
    tensors = list(tensors_in(loaded))
    assert [t.shape for t in tensors] == [(300, 77), (300,)]
    # a view starting inside a page: the range is aligned down to the page
    done = populate([*tensors, tensors[0][1:, 3:]])
    assert done is True or not supported()
    torch.testing.assert_close(loaded["blocks"][0]["rows"], saved["blocks"][0]["rows"], rtol=0, atol=0)
    assert torch.equal(loaded["blocks"][0]["ids"], saved["blocks"][0]["ids"])


def test_without_the_system_call_nothing_happens(monkeypatch):
    monkeypatch.setattr(mapped_pages, "_MADVISE", None)
    rows = torch.randn(10, 3)
    assert populate([rows]) is False
    assert populate([]) is False


def test_a_refused_range_is_reported_not_raised(monkeypatch):
    calls = []

    def refuse(address, length, advice):
        calls.append((address % mapped_pages.mmap.PAGESIZE, length, advice))
        return -1

    monkeypatch.setattr(mapped_pages, "_MADVISE", refuse)
    rows = torch.randn(1000, 5)
    assert populate([rows, rows[3:]]) is False
    assert calls == [(0, rows.untyped_storage().nbytes() + rows.data_ptr() % mapped_pages.mmap.PAGESIZE, 22)]
