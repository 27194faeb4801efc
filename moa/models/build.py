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
    return build_from_args(model_args(arch, extra_args, share_all_embeddings), dictionary)


def model_args(arch: str, extra_args: Sequence[str] = (), share_all_embeddings: bool = True) -> argparse.Namespace:
    """The model namespace ``fairseq-train --arch ARCH EXTRA_ARGS`` parses (arch defaults not yet applied)."""
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(f"unknown arch {arch!r}; import moa first to register the MoA archs")
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    args = parser.parse_args(list(extra_args))
    args.arch = arch
    args.share_all_embeddings = share_all_embeddings
    return args


def build_from_args(args: argparse.Namespace, source_dictionary: Dictionary, target_dictionary: Dictionary = None):
    """The model of ``args.arch`` (its arch defaults applied, as fairseq does) on these dictionaries;
    masked-LM archs read the source dictionary and get 512 positions unless ``args`` names them."""
    target_dictionary = source_dictionary if target_dictionary is None else target_dictionary
    ARCH_CONFIG_REGISTRY[args.arch](args)
    task = types.SimpleNamespace(source_dictionary=source_dictionary, target_dictionary=target_dictionary,
                                 max_positions=lambda: 512)
    return ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
