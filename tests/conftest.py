"""pytest's fixtures for the whole suite; what the tests share otherwise is in ``helpers.py``."""

import pytest
import torch

from helpers import TINY, build_model


@pytest.fixture(params=[2, 4], ids=["routed-2of4", "dense-4of4"])
def tiny_model(request):
    """A 2+2-layer MoA translation model, with k < E (routed path) and k == E (dense path)."""
    torch.manual_seed(0)
    return build_model("moa_small", 40, TINY + ["--moa-top-k", str(request.param)]).eval()
