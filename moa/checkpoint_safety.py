"""Loading fairseq checkpoints with torch's safe (weights-only) unpickler.

Since torch 2.6 ``torch.load`` only rebuilds allow-listed classes, and fairseq's
checkpoints of argparse-style models (``transformer``, ``moa_transformer``)
hold an ``argparse.Namespace``; checkpoints trained with ``--eval-bleu`` also
hold numpy arrays in their meters. This module allow-lists exactly those
classes, keeping the safe loader on: a checkpoint whose pickle names anything
else (``os.system``, say) is refused by torch with ``Weights only load failed``.
"""

import argparse

import numpy as np
import torch


def fairseq_checkpoint_globals():
    """The classes and functions that fairseq translation/MLM checkpoints pickle."""
    return [
        argparse.Namespace,
        np.dtype,
        np.ndarray,
        np.dtypes.Int64DType,
        np.dtypes.Float64DType,
        _numpy_reconstruct(),
    ]


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
    return core.multiarray._reconstruct


def allow_fairseq_checkpoint_globals() -> None:
    """Register :func:`fairseq_checkpoint_globals` with torch's weights-only unpickler."""
    torch.serialization.add_safe_globals(fairseq_checkpoint_globals())


def broadcast_state_globals():
    """What a fairseq training state holds besides :func:`fairseq_checkpoint_globals` once loaded:
    rank 0 sends it to the other ranks when a data-parallel run resumes (fairseq's
    ``broadcast_object``), pickled with its omegaconf config and fairseq's tensor placeholders.
    Allowed only while a broadcast is received (:mod:`moa.distributed`), never for files."""
    import collections
    import typing

    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig, base, nodes

    return [*fairseq_checkpoint_globals(), DictConfig, ListConfig, base.ContainerMetadata, base.Metadata,
            nodes.AnyNode, typing.Any, collections.defaultdict, dict, list, int, _TensorPlaceholder]
