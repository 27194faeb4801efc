"""Averaging the parameters of fairseq checkpoints, loaded through torch's safe (weights-only) loader.

The fairseq package ships no ``average_checkpoints.py``; this is the same operation with the
plugin's allow-list instead of unpickling arbitrary code. torch and the plugin are imported when
a function runs, not when this module is imported.
"""

import collections
import os
import re

from moa_tools import ToolError


def last_checkpoints(folder: str, count: int, by_update: bool, upper_bound=None):
    """The ``count`` newest epoch (checkpointN.pt) or update (checkpoint_E_U.pt) checkpoints in ``folder``."""
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(folder):
        match = pattern.fullmatch(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    if len(found) < count:
        kind = "update" if by_update else "epoch"
        raise ToolError(f"{folder} holds {len(found)} {kind} checkpoints, fewer than the {count} asked for")
    return [path for _, path in sorted(found)[-count:]]


def load_checkpoint(path: str) -> dict:
    """A fairseq checkpoint through the safe loader; an unsafe pickle, a truncated file or a file
    without model state is a :class:`ToolError` naming ``path``."""
    import pickle

    import torch

    import moa  # noqa: F401  (registers the checkpoint allow-list)
    from moa.fairseq_fixes.checkpoint_safety import DamagedCheckpointError, verified_checkpoint

    try:
        with verified_checkpoint(path) as checked:  # read from disk once, loaded from the bytes checked
            state = torch.load(checked, map_location="cpu")  # weights_only: the safe loader
    except DamagedCheckpointError as e:
        raise ToolError(str(e)) from None
    except pickle.UnpicklingError as e:
        raise ToolError(f"{path} cannot be loaded safely: {e}") from e
    except (RuntimeError, EOFError) as e:
        raise ToolError(f"{path} cannot be read as a checkpoint ({e})") from e
    if not isinstance(state, dict) or "model" not in state:
        raise ToolError(f"{path} is not a fairseq checkpoint: it holds no 'model' state")
    return state


def average(paths):
    """The newest checkpoint's state with ``model`` replaced by the mean over ``paths``."""
    total, newest, keys = collections.OrderedDict(), None, None
    for path in paths:
        state = load_checkpoint(path)
        model = state["model"]
        if keys is None:
            keys = list(model)
        elif list(model) != keys:
            raise ToolError(f"{path} holds other parameters than {paths[0]}: not checkpoints of one model")
        for name, tensor in model.items():
            value = tensor.double() if tensor.is_floating_point() else tensor
            total[name] = value.clone() if name not in total else total[name] + value
        newest = state
    for name, tensor in total.items():
        reference = newest["model"][name]
        total[name] = (tensor / len(paths)).to(reference.dtype) if reference.is_floating_point() else reference
    newest["model"] = total
    return newest


def save_atomically(state: dict, path: str) -> None:
    """``torch.save`` to a temporary name, flushed to disk and renamed into place when complete: a
    kill at any moment leaves the old file or the new one, never part of one."""
    import torch

    from moa.fairseq_fixes.atomic_files import atomic_file

    with atomic_file(path) as temporary:
        torch.save(state, temporary)
