"""Loading fairseq checkpoints with torch's safe (weights-only) unpickler.

Since torch 2.6 ``torch.load`` only rebuilds allow-listed classes, and fairseq's
checkpoints of argparse-style models (``transformer``, ``moa_transformer``)
hold an ``argparse.Namespace``; checkpoints trained with ``--eval-bleu`` also
hold numpy arrays in their meters. This module allow-lists exactly those
classes, keeping the safe loader on: a checkpoint whose pickle names anything
else (``os.system``, say) is refused by torch with ``Weights only load failed``.
"""

import argparse
import contextlib
import io
import mmap
import os
import re
import zipfile
import zlib
from typing import List, Optional

import numpy as np
import torch

from moa.fairseq_fixes.named_errors import NamedInputError


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
    Allowed only while a broadcast is received (:mod:`moa.fairseq_fixes.distributed`), never for files."""
    import collections
    import typing

    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig, base, nodes

    return [*fairseq_checkpoint_globals(), DictConfig, ListConfig, base.ContainerMetadata, base.Metadata,
            nodes.AnyNode, typing.Any, collections.defaultdict, dict, list, int, _TensorPlaceholder]


class DamagedCheckpointError(NamedInputError, RuntimeError):
    """A checkpoint file ``path`` that is not a complete torch archive (an interrupted save or copy), and
    why (``reason``). Its message names the fix (:func:`damaged_checkpoint_message`), looked for only when
    the message is read: a caller that falls back to another checkpoint reads no other file for it."""

    def __init__(self, path: str, reason: str):
        super().__init__(path, reason)
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return damaged_checkpoint_message(self.path, self.reason)


def checkpoint_damage(path: str) -> Optional[str]:
    """Why the local file ``path`` is not a complete torch checkpoint, or None when it is one (or is
    not a local file, or is in torch's legacy non-zip format, which has no checksums).

    torch's zip format writes its central directory last, so any truncation loses it; each member
    carries a CRC-32, which ``torch.load`` does not check (a flipped byte loads as a wrong weight),
    so this reads the whole file once and checks every member.
    """
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return _archive_damage(f)


def _archive_damage(f) -> Optional[str]:
    """Why the open file ``f`` is not a complete torch archive, or None (also for a legacy pickle)."""
    try:
        with zipfile.ZipFile(f) as archive:
            bad = archive.testzip()
            return None if bad is None else (f"its member {bad} fails its CRC-32 check: bytes changed after it "
                                             "was written")
    except zipfile.BadZipFile:
        f.seek(0)
        if f.read(1) == b"\x80":  # a pickle: torch's legacy format
            return None
        return ("it has no zip central directory, so it ends early: the save or copy that wrote it did not "
                "finish")
    except (OSError, EOFError, ValueError, zlib.error) as e:
        return f"it cannot be read through ({e})"


def damaged_checkpoint_message(path: str, reason: str) -> str:
    """What is wrong with a damaged checkpoint and what to use instead: the newest complete checkpoint
    of its run beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    match = re.fullmatch(RUN_CHECKPOINT.format(suffix="(.*?)"), os.path.basename(path))
    newest = newest_complete_checkpoint(folder, exclude=path, suffix=match.group(1) if match else "")
    if newest:
        fix = (f"Start from the newest complete checkpoint beside it instead: fairseq-train ... --restore-file "
               f"{newest} to resume training, --path {newest} to evaluate.")
    else:
        fix = f"{folder} holds no other complete checkpoint: restore the file from a copy, or train again."
    return f"{path} is truncated or corrupt: {reason}. {fix}"


# The files fairseq-train writes into --save-dir for a run of checkpoint suffix S (--checkpoint-suffix, and
# "-shard<rank>" for sharded states): checkpoint_last, checkpoint_best, checkpoint<epoch>,
# checkpoint_<epoch>_<updates> and the best-k checkpoint.best_<metric>_<value>.
RUN_CHECKPOINT = r"checkpoint(?:_last|_best|\d+|_\d+_\d+|\.best_\w+?_-?[\d.]+?){suffix}\.pt"


def run_checkpoints(folder: str, suffix: str = "") -> List[str]:
    """The checkpoints of the run of ``suffix`` in ``folder`` (:data:`RUN_CHECKPOINT`), newest first: never
    another shard's, or a file of another name."""
    pattern = re.compile(RUN_CHECKPOINT.format(suffix=re.escape(suffix)))
    names = [name for name in os.listdir(folder) if pattern.fullmatch(name)]
    return sorted((os.path.join(folder, name) for name in names), key=os.path.getmtime, reverse=True)


def newest_complete_checkpoint(folder: str, exclude: str, suffix: str = "") -> Optional[str]:
    """The newest complete checkpoint of the run of ``suffix`` in ``folder`` other than ``exclude``."""
    return next((path for path in run_checkpoints(folder, suffix) if os.path.abspath(path) != os.path.abspath(exclude)
                 and checkpoint_damage(path) is None), None)


class _MappedFile(io.RawIOBase):
    """A read-only file over a memory map: what the checksums are computed on is what torch then loads."""

    def __init__(self, mapping: mmap.mmap):
        super().__init__()
        self._mapping = mapping

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, buffer):
        data = self._mapping.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset, whence=io.SEEK_SET):
        self._mapping.seek(offset, whence)
        return self._mapping.tell()

    def tell(self):
        return self._mapping.tell()

    def close(self):  # the mapping is its owner's to close
        pass


@contextlib.contextmanager
def verified_checkpoint(path: str):
    """``path`` mapped into memory once, its CRC-32s checked on the mapped bytes (a damaged file raises
    :class:`DamagedCheckpointError`), yielding a file to load from the same bytes: the disk is read once.
    A legacy (non-zip) torch file, which has no checksums, is yielded as it is mapped."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise DamagedCheckpointError(path, "it is empty: the save that wrote it did not finish")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            mapped = _MappedFile(mapping)
            reason = _archive_damage(mapped)
            if reason is not None:
                raise DamagedCheckpointError(path, reason)
            mapped.seek(0)
            yield mapped


_LOADED = [None]  # the checkpoint fairseq's loader read last


def last_loaded_checkpoint() -> Optional[str]:
    """The path fairseq's ``load_checkpoint_to_cpu`` read last in this process (for messages), or None."""
    return _LOADED[0]


def checked_checkpoint_loader(load):
    """fairseq's ``load_checkpoint_to_cpu`` (``load``), which loads a local file from the bytes whose
    checksums :func:`verified_checkpoint` checked, so that a damaged file is refused by name, with the
    fix, instead of failing in torch's zip reader or, for a corrupt byte, loading wrong weights; the file
    is read from disk once (see :mod:`moa.fairseq_fixes.patches`)."""
    import fairseq.checkpoint_utils as checkpoint_utils

    def load_checkpoint_to_cpu(path, *args, **kwargs):
        _LOADED[0] = str(path)
        if "://" in str(path) or not os.path.isfile(path):
            return load(path, *args, **kwargs)
        with verified_checkpoint(path) as mapped:
            local = os.path.abspath(path)

            def serve_mapped(file, mode="r", *open_args, **open_kwargs):  # fairseq opens the path to torch.load it
                if mode == "rb" and isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == local:
                    return contextlib.nullcontext(mapped)
                return open(file, mode, *open_args, **open_kwargs)

            previous = checkpoint_utils.__dict__.get("open")
            checkpoint_utils.open = serve_mapped  # a module global, found before the builtin; for this call only
            try:
                return load(path, *args, **kwargs)
            finally:
                if previous is None:
                    del checkpoint_utils.open
                else:
                    checkpoint_utils.open = previous

    return load_checkpoint_to_cpu
