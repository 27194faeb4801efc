"""Loading fairseq checkpoints with torch's safe (weights-only) unpickler.

Since torch 2.6 ``torch.load`` only rebuilds allow-listed classes, and fairseq's
checkpoints of argparse-style models (``transformer``, ``moa_transformer``)
hold an ``argparse.Namespace``; checkpoints trained with ``--eval-bleu`` also
hold numpy arrays in their meters. This module allow-lists exactly those
classes, keeping the safe loader on: a checkpoint whose pickle names anything
else (``os.system``, say) is refused by torch with ``Weights only load failed``.
"""

import argparse
import os
import zipfile

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


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file that is not a complete torch archive (an interrupted save or copy)."""


def is_damaged_checkpoint(path: str) -> bool:
    """True when the local file ``path`` is not a complete, readable torch zip archive: its central
    directory (written last) is missing, or a member fails its CRC."""
    if not os.path.isfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is not None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return True


def damaged_checkpoint_message(path: str, error: BaseException) -> str:
    """What a damaged checkpoint is and what to use instead: the newest complete checkpoint beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    others = sorted((os.path.join(folder, name) for name in os.listdir(folder)
                     if name.endswith(".pt") and os.path.join(folder, name) != os.path.abspath(path)),
                    key=os.path.getmtime, reverse=True)
    newest = next((other for other in others if not is_damaged_checkpoint(other)), None)
    if newest:
        fix = (f"Start from the newest complete checkpoint beside it instead: fairseq-train ... --restore-file "
               f"{newest} to resume training, --path {newest} to evaluate.")
    else:
        fix = f"{folder} holds no other complete checkpoint: restore the file from a copy, or train again."
    reason = str(error).split(". ")[0]
    return f"{path} is truncated or corrupt ({reason}): the save or copy that wrote it did not finish. {fix}"


def fail_clearly_on_damaged_checkpoints() -> None:
    """Make fairseq's checkpoint loading (training resume, generate, validate, interactive) report
    a damaged file by name, with :func:`damaged_checkpoint_message`, instead of torch's zip error."""
    from fairseq import checkpoint_utils

    load = getattr(checkpoint_utils.load_checkpoint_to_cpu, "fairseq_load", checkpoint_utils.load_checkpoint_to_cpu)

    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as error:
            if is_damaged_checkpoint(path):
                raise DamagedCheckpointError(damaged_checkpoint_message(path, error)) from error
            raise

    load_checkpoint_to_cpu.fairseq_load = load
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
