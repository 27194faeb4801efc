"""Counting the operations that make the host wait for the device, on a CPU.

On a GPU each of these drains the device's queue before Python continues: a tensor read into Python
(``tolist``, ``item``, ``bool``/``int``/``float``/``index``, ``torch.equal``), a tensor built from
Python numbers (a host-to-device copy), and an operation whose output shape depends on the data
(``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, and
``bincount``, which reads its input's range). :class:`HostReads` records every call of one of them
made under it, with the first caller outside torch, so that a CPU test can prove a GPU path free of
them.
"""

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.equal}
FROM_PYTHON = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor, torch.scalar_tensor}
DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                  torch.unique, torch.Tensor.unique, torch.bincount, torch.Tensor.bincount}
TORCH = os.path.dirname(torch.__file__)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; then ``reads.calls``: [(operation, "file:line")]."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or func in DATA_DEPENDENT or (func in FROM_PYTHON and not _is_tensor_data(func, args)) or \
                (func in (torch.repeat_interleave, torch.Tensor.repeat_interleave)
                 and torch.is_tensor(args[1] if len(args) > 1 else kwargs.get("repeats"))
                 and kwargs.get("output_size") is None):
            self.calls.append((getattr(func, "__name__", str(func)), _caller()))
        return func(*args, **kwargs)

    def from_package(self, package: str):
        """The calls whose first caller outside torch is in ``package`` (a top-level folder name)."""
        return [(name, where) for name, where in self.calls if f"{os.sep}{package}{os.sep}" in where]


def _is_tensor_data(func, args):
    data = args[1] if func is torch.Tensor.new_tensor and len(args) > 1 else args[0] if args else None
    return torch.is_tensor(data)


def _caller():
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
