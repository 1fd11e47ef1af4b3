"""Property tests run thousands of tiny tensor ops: one intra-op thread for every module here
(`one_torch_thread` in tests/conftest.py restores the count afterwards)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def single_intra_op_thread(one_torch_thread):
    yield
