"""pytest's fixtures for the whole suite; what the tests share otherwise is in ``helpers.py``."""

import os

# Under pytest-xdist (the slow set runs with ``-n 2``) the workers share the cores: each one, and every CLI it
# starts (they inherit the variable), computes on one thread, so that two workers do not oversubscribe them.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)  # in case torch was imported before this file

from helpers import TINY, build_model


@pytest.fixture(params=[2, 4], ids=["routed-2of4", "dense-4of4"])
def tiny_model(request):
    """A 2+2-layer MoA translation model, with k < E (routed path) and k == E (dense path)."""
    torch.manual_seed(0)
    return build_model("moa_small", 40, TINY + ["--moa-top-k", str(request.param)]).eval()
