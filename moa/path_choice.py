"""Choosing between equivalent code paths by timing them where they run.

Some of the routed modules' decisions have no answer that holds on every processor: whether a decoding
step of MoA computes every expert in one matmul or only the selected ones expert by expert, whether
attention over a few queries is faster as two matmuls or torch's fused kernel, whether MoH packs its
routed heads. Which is faster depends on the CPU's (or GPU's) kernels, not on arithmetic that a
constant could capture, and constants fitted on one machine were wrong on the next. So these decisions
are measured: :func:`fastest` runs each candidate a few times on the real inputs, interleaved, the
first time it meets a problem of a given size (:func:`bucket`) on a device and dtype, remembers the
fastest for the rest of the process, and returns its result, as ``torch.backends.cudnn.benchmark``
does for convolutions. The first candidate (each decision's default) stays unless another is faster
by more than ``MARGIN``, so that near-ties, which a few runs cannot separate, do not flip between
processes.

Measuring happens only in forwards without autograd (decoding, generation, validation, eval-lm), where
running a path again changes nothing. A forward with autograd (training) takes the path its caller names
as the training path, chosen by arithmetic, so that a run and its resumption take the same paths.

``MOA_PATH_CHOICE=default`` in the environment (or :func:`defaults`) turns measuring off: every decision
then takes its first candidate, and inference repeats bit for bit between processes. A module can also
be pinned to one path (its ``path`` attribute), which the tests do to compare the paths.
"""

import contextlib
import os
import statistics
import time
from typing import Callable, Dict, Hashable, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")
REPEATS = 7  # timed runs of each candidate, after one untimed run
MARGIN = 0.05  # another candidate replaces the first only when its median time is this much lower
_chosen: Dict[Tuple[Hashable, ...], str] = {}
_measure = os.environ.get("MOA_PATH_CHOICE", "measure") != "default"


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two: problem sizes within a factor of two share a decision."""
    return 1 << max(int(n) - 1, 0).bit_length()


def fastest(decision: str, size: Tuple[Hashable, ...], candidates: Dict[str, Callable[[], T]],
            training: Optional[str] = None, pinned: Optional[str] = None) -> T:
    """The result of the fastest of ``candidates`` (name -> a call that computes the same thing) for
    ``decision`` at problem ``size`` (bucketed ints, shapes, dtypes: what the timing depends on).

    ``pinned`` (a candidate's name) is taken as it is. With autograd on, ``training`` is taken (the
    first candidate when None). Otherwise the choice measured for this decision and size, measuring it
    now if it is new."""
    if pinned is not None:
        return candidates[pinned]()
    if torch.is_grad_enabled():
        return candidates[training or next(iter(candidates))]()
    if not _measure or len(candidates) == 1:
        return next(iter(candidates.values()))()
    key = (decision,) + tuple(size)
    name = _chosen.get(key)
    if name is not None:
        return candidates[name]()
    name, result = _time(candidates)
    _chosen[key] = name
    return result


def _time(candidates: Dict[str, Callable[[], T]]) -> Tuple[str, T]:
    results, times = {}, {name: [] for name in candidates}
    for round_ in range(REPEATS + 1):
        for name, run in candidates.items():
            _synchronize()
            start = time.perf_counter()
            results[name] = run()
            _synchronize()
            if round_:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(candidates))
    name = min(medians, key=medians.get)
    if medians[name] > (1 - MARGIN) * medians[first]:  # within the noise of a few runs: keep the first
        name = first
    return name, results[name]


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def chosen() -> Dict[Tuple[Hashable, ...], str]:
    """Every decision measured in this process so far: (decision, *size) -> the fastest candidate."""
    return dict(_chosen)


@contextlib.contextmanager
def defaults():
    """Within the block, no measuring: every decision takes its first candidate (as with
    ``MOA_PATH_CHOICE=default``)."""
    global _measure
    saved, _measure = _measure, False
    try:
        yield
    finally:
        _measure = saved


def forget() -> None:
    """Drop every measured choice (the next forwards measure again)."""
    _chosen.clear()
