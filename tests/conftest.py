"""Fixtures shared across the test folders (a folder's own fixtures live in its conftest.py)."""

import os

import pytest

# Ranks spawned by tests share 2 cores; keep each process single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def eager_flex(monkeypatch):
    """The flex backend runs eager `flex_attention` instead of the compiled kernel: on CPU the compiled form
    has no backward and cannot return the LSE, while eager flex computes the same block-masked attention."""
    from torch.nn.attention.flex_attention import flex_attention

    import specforge_csbp.attention.flex as flex_backend

    monkeypatch.setattr(flex_backend, "_compiled_flex", lambda: flex_attention)


def pytest_collection_modifyitems(config, items):
    """Files holding a `slow` test (> 60 s on 2 cores) are collected first. scripts/test.sh hands whole files to
    pytest-xdist workers in collection order (--dist loadfile): a long file handed out last would keep one
    worker busy while the others sit idle at the end. The order inside and among the other files is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
