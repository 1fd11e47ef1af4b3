"""Property tests run thousands of tiny tensor ops: one intra-op thread keeps them fast on a
shared CI machine (thread hand-offs cost more than the ops). Restored afterwards."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
