"""What the benchmarks (and the tests) share: the repository's paths and the real data's location.

The real corpora live outside the repository (never copied into it): ``$MOA_SHARED_DATA``, by
default ``../shared/data`` beside the checkout (see its README for what each folder holds).
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.environ.get("MOA_SHARED_DATA") or os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def shared_data(*parts: str) -> str:
    """The path of ``parts`` under the shared data folder (it may not exist on this machine)."""
    return os.path.join(SHARED_DATA, *parts)


def moa_expert_flags(moa_config: str) -> list:
    """fairseq-train's MoA expert flags for a configuration written as in the paper, kKeEdD (top-k of e
    experts of width d, e.g. 4K8E64D); ValueError naming the expected form otherwise."""
    shape = re.fullmatch(r"(\d+)K(\d+)E(\d+)D", moa_config)
    if not shape or int(shape.group(1)) > int(shape.group(2)):
        raise ValueError(f"--moa-config {moa_config!r}: expected kKeEdD with k <= e, such as 4K8E64D")
    k, e, d = shape.groups()
    return ["--moa-top-k", k, "--moa-experts", e, "--moa-head-dim", d]
