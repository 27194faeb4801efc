"""What the benchmarks (and the tests) share: the repository's paths and the real data's location.

The real corpora live outside the repository (never copied into it): ``$MOA_SHARED_DATA``, by
default ``../shared/data`` beside the checkout (see its README for what each folder holds).
"""

import os
import re
import sys

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


def provenance(module: str, argv=None) -> dict:
    """What made a result: the command line (``python -m benchmarks.MODULE ARGS``), the commit of this
    checkout (``+changes`` when it had uncommitted changes to tracked files), torch, fairseq and Python
    versions, the machine and the time. Every result file and row of the benchmarks carries one."""
    import datetime
    import platform
    import shlex
    import subprocess

    import fairseq
    import torch

    def git(*args):
        try:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    argv = sys.argv[1:] if argv is None else list(argv)
    return {"command": shlex.join(["python", "-m", f"benchmarks.{module}", *argv]), "commit": commit,
            "torch": torch.__version__, "fairseq": fairseq.__version__, "python": platform.python_version(),
            "machine": machine(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def machine() -> str:
    """The processor, core count and accelerator, in one line."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    text = f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def provenance_line(run: dict) -> str:
    """One Markdown line that says what :func:`provenance` recorded."""
    return (f"Written by `{run['command']}` at commit {run['commit']} (torch {run['torch']}, fairseq "
            f"{run['fairseq']}, Python {run['python']}) on {run['machine']}, {run['date']}.")


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name, creating its folder."""
    from moa_tools.textio import atomic_text_outputs

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_text_outputs(path) as (f,):
        f.write(text)
