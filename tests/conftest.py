"""Shared helpers: building MoA models directly (no data on disk) for module-level tests."""

import pytest
import torch

import moa  # noqa: F401  (registers the plugin)
from moa.models.build import build_translation_model, dictionary_of_size


def build_model(arch: str, dict_size: int = 64, extra=()):
    """Build a registered fairseq model by arch name, as fairseq-train would, on a joined dictionary."""
    return build_translation_model(arch, dictionary_of_size(dict_size), extra)


TINY = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
        "--dropout", "0", "--attention-dropout", "0", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2"]


@pytest.fixture(params=[2, 4], ids=["routed-2of4", "dense-4of4"])
def tiny_model(request):
    """A 2+2-layer MoA translation model, with k < E (routed path) and k == E (dense path)."""
    torch.manual_seed(0)
    return build_model("moa_small", 40, TINY + ["--moa-top-k", str(request.param)]).eval()
