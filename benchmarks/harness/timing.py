"""Timing side by side: jobs take turns round after round, so that a machine that slows for a while slows
them all, and a figure is a median over rounds (a ratio: the median of the per-round ratios)."""

import statistics
import time


def synchronize(device=None) -> None:
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.synchronize()


def seconds(job, device=None) -> float:
    """Wall seconds of one call of ``job`` (CUDA work waited for)."""
    synchronize(device)
    start = time.perf_counter()
    job()
    synchronize(device)
    return time.perf_counter() - start


def median_time(job, repeats: int, warmup: int = 1, device=None) -> float:
    """Median seconds of ``repeats`` calls of ``job`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        job()
    return statistics.median(seconds(job, device) for _ in range(repeats))


def interleaved(jobs: dict, rounds: int, warmup: int = 1, repeats: int = 1, device=None) -> dict:
    """{name: [seconds per round]}: every job of ``jobs`` ({name: callable}) in turn, ``warmup`` untimed
    rounds and then ``rounds`` timed ones; a round's figure is the median of ``repeats`` calls."""
    times = {name: [] for name in jobs}
    for round_ in range(warmup + rounds):
        for name, job in jobs.items():
            figure = median_time(job, repeats, 0, device)
            if round_ >= warmup:
                times[name].append(figure)
    return times


def ms(times) -> float:
    """The median of ``times`` (seconds), in milliseconds."""
    return 1e3 * statistics.median(times)


def ratio(own, base) -> float:
    """The median of the per-round ratios own / base."""
    return statistics.median(a / b for a, b in zip(own, base))
