from __future__ import annotations

import pytest
import torch

# Tests are small: one thread keeps them fast and their timing steady on 2 cores.
torch.set_num_threads(1)


@pytest.fixture
def trace_path(tmp_path):
    return tmp_path / "trace.h5"
