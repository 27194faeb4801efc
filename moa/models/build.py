"""Build a registered fairseq model by arch name, outside fairseq-train (benchmarks, tests, Python use)."""

import argparse
import types
from typing import Sequence

from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY


def dictionary_of_size(size: int) -> Dictionary:
    """A fairseq Dictionary of exactly ``size`` symbols (its 4 special symbols included)."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


def build_translation_model(arch: str, dictionary: Dictionary, extra_args: Sequence[str] = (),
                            share_all_embeddings: bool = True):
    """The model ``fairseq-train --arch ARCH EXTRA_ARGS`` would build on a joined dictionary
    (translation archs; masked-LM archs get the dictionary as their source and 512 positions)."""
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(f"unknown arch {arch!r}; import moa first to register the MoA archs")
    model_cls = ARCH_MODEL_REGISTRY[arch]
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    model_cls.add_args(parser)
    args = parser.parse_args(list(extra_args))
    args.arch = arch
    args.share_all_embeddings = share_all_embeddings
    ARCH_CONFIG_REGISTRY[arch](args)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary, max_positions=lambda: 512)
    return model_cls.build_model(args, task)
