"""Fixtures every test suite can ask for by name."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models on 2 shared cores: one intra-op thread avoids OpenMP spinning against other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
