"""pytest's fixtures for the whole suite; what the tests share otherwise is in ``helpers.py``."""

import os

import pytest
import torch

# Under pytest-xdist (the slow set runs with ``-n 2``) the workers share the cores: each one computes on one
# thread, and so does every CLI it starts (they inherit the variable), so that two workers do not oversubscribe
# them.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from helpers import TINY, build_model


@pytest.fixture(params=[2, 4], ids=["routed-2of4", "dense-4of4"])
def tiny_model(request):
    """A 2+2-layer MoA translation model, with k < E (routed path) and k == E (dense path)."""
    torch.manual_seed(0)
    return build_model("moa_small", 40, TINY + ["--moa-top-k", str(request.param)]).eval()
