"""Tests marked `gpu` need a CUDA device; elsewhere (CI, laptops) they are skipped, not failed."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder's name
            item.add_marker(skip)
