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
import zlib
from typing import Optional

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


def checkpoint_damage(path: str) -> Optional[str]:
    """Why the local file ``path`` is not a complete torch checkpoint, or None when it is one (or is
    not a local file, or is in torch's legacy non-zip format, which has no checksums).

    torch's zip format writes its central directory last, so any truncation loses it; each member
    carries a CRC-32, which ``torch.load`` does not check (a flipped byte loads as a wrong weight),
    so this reads the whole file once and checks every member.
    """
    if not os.path.isfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            return None if bad is None else (f"its member {bad} fails its CRC-32 check: bytes changed after it "
                                             "was written")
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            if f.read(1) == b"\x80":  # a pickle: torch's legacy format
                return None
        return ("it has no zip central directory, so it ends early: the save or copy that wrote it did not "
                "finish")
    except (OSError, EOFError, ValueError, zlib.error) as e:
        return f"it cannot be read through ({e})"


def damaged_checkpoint_message(path: str, reason: str) -> str:
    """What is wrong with a damaged checkpoint and what to use instead: the newest complete checkpoint
    beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    newest = newest_complete_checkpoint(folder, exclude=path)
    if newest:
        fix = (f"Start from the newest complete checkpoint beside it instead: fairseq-train ... --restore-file "
               f"{newest} to resume training, --path {newest} to evaluate.")
    else:
        fix = f"{folder} holds no other complete checkpoint: restore the file from a copy, or train again."
    return f"{path} is truncated or corrupt: {reason}. {fix}"


def newest_complete_checkpoint(folder: str, exclude: str) -> Optional[str]:
    """The newest (by modification time) complete ``*.pt`` checkpoint in ``folder`` other than ``exclude``."""
    candidates = sorted((os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".pt")),
                        key=os.path.getmtime, reverse=True)
    return next((path for path in candidates if os.path.abspath(path) != os.path.abspath(exclude)
                 and checkpoint_damage(path) is None), None)


def check_checkpoint_file(path: str) -> None:
    """Raise :class:`DamagedCheckpointError` if ``path`` is a damaged checkpoint file."""
    reason = checkpoint_damage(path)
    if reason is not None:
        raise DamagedCheckpointError(damaged_checkpoint_message(path, reason))


def checked_checkpoint_loader(load):
    """fairseq's ``load_checkpoint_to_cpu`` (``load``) behind :func:`check_checkpoint_file`, so that a
    damaged file is refused by name, with the fix, instead of failing in torch's zip reader or, for a
    corrupt byte, loading wrong weights (see :mod:`moa.fairseq_patches`)."""

    def load_checkpoint_to_cpu(path, *args, **kwargs):
        check_checkpoint_file(path)
        return load(path, *args, **kwargs)

    return load_checkpoint_to_cpu
