"""Shared pytest setup: the test folder on sys.path (for the model zoo), quiet torch threads."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
