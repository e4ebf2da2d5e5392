"""Tests marked `gpu` need a CUDA device; elsewhere (CI, laptops) they are skipped, not failed.
`spy`: which kernel a layer's dispatch took."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder's name
            item.add_marker(skip)


@pytest.fixture
def spy(monkeypatch):
    """spy(owner, name) -> a list that gains `name` at each call of owner.name (an op on
    torch.ops.latentserve or a module function), the call itself unchanged."""
    def watch(owner, name: str) -> list:
        calls, fn = [], getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a: calls.append(name) or fn(*a))
        return calls
    return watch
