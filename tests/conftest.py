"""Shared helpers: building MoA models directly (no data on disk) for module-level tests."""

import argparse
import types

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

import moa  # noqa: F401  (registers the plugin)


def make_dictionary(size: int) -> Dictionary:
    """A fairseq Dictionary of exactly ``size`` symbols (the 4 specials included)."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    assert len(d) == size
    return d


def build_model(arch: str, dict_size: int = 64, extra=()):
    """Build a registered fairseq model by arch name, as fairseq-train would, on a joined dictionary."""
    model_cls = ARCH_MODEL_REGISTRY[arch]
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    model_cls.add_args(parser)
    args = parser.parse_args(list(extra))
    args.share_all_embeddings = True
    args.arch = arch
    ARCH_CONFIG_REGISTRY[arch](args)
    d = make_dictionary(dict_size)
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    return model_cls.build_model(args, task)


TINY = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
        "--dropout", "0", "--attention-dropout", "0", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2"]


@pytest.fixture(params=[2, 4], ids=["routed-2of4", "dense-4of4"])
def tiny_model(request):
    """A 2+2-layer MoA translation model, with k < E (routed path) and k == E (dense path)."""
    torch.manual_seed(0)
    return build_model("moa_small", 40, TINY + ["--moa-top-k", str(request.param)]).eval()
