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


@pytest.fixture(autouse=True)
def _fresh_titan_logger():
    """Every test starts with the 'titan_npu' logger as Python makes it: an in-process train run (setup_logging)
    points it at that run's captured stdout and stops propagation, which would hide records from later tests."""
    import logging

    logger = logging.getLogger("titan_npu")
    logger.handlers[:] = []
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
    yield
