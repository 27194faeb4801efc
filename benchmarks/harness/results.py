"""Where results go and what they say about their making: paths, provenance, atomic writing, tables.

The real corpora live outside the repository (never copied into it): ``$MOA_SHARED_DATA``, by
default ``../shared/data`` beside the checkout (see its README for what each folder holds).
"""

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys

from moa_tools import ToolError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = os.environ.get("MOA_SHARED_DATA") or os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))


def shared_data(*parts: str) -> str:
    """The path of ``parts`` under the shared data folder (it may not exist on this machine)."""
    return os.path.join(SHARED_DATA, *parts)


def require_shared(path: str) -> str:
    """``path`` (under the shared data folder), or a ToolError that says how to point at it."""
    if not os.path.exists(path):
        folder = os.path.relpath(path, SHARED_DATA).split(os.sep)[0]
        raise ToolError(f"{path} is missing: this study reads the shared data "
                        f"(set MOA_SHARED_DATA to the folder that holds {folder}/)")
    return path


def study_results(study: str, *parts: str) -> str:
    """The results folder of a study (``benchmarks/STUDY/results/PARTS``)."""
    return os.path.join(ROOT, "benchmarks", study, "results", *parts)


def provenance(module: str, argv=None) -> dict:
    """What made a result: the command line (``python -m benchmarks.MODULE ARGS``), the commit of this
    checkout (``+changes`` when it had uncommitted changes to tracked files), torch, fairseq and Python
    versions, the machine, torch's intra-op threads (a float sum's order, and so a long run's last digits,
    depends on them) and the time. Every result file and row carries one."""
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
            "machine": machine(), "threads": torch.get_num_threads(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def machine() -> str:
    """The processor, core count and accelerator, in one line."""
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


# Study modules by their names before the benchmarks were grouped in packages: a recorded command names the
# module as it was; its results are remade by the module it is now.
RENAMED = {"benchmarks.lm_wikitext2": "benchmarks.wikitext.lm", "benchmarks.mlm_wikitext2": "benchmarks.wikitext.mlm",
           "benchmarks.multi30k_converged": "benchmarks.multi30k.converged",
           "benchmarks.translation_multi30k": "benchmarks.multi30k.equal_time",
           "benchmarks.moa_speed": "benchmarks.speed.models_and_modules", "benchmarks.bf16_cpu": "benchmarks.speed.bf16",
           "benchmarks.torch_compile": "benchmarks.speed.compile", "benchmarks.lm_decoding": "benchmarks.speed.lm_decoding",
           "benchmarks.gpu_check": "benchmarks.dev.gpu_check"}


def command_note(command: str) -> str:
    """`` (that module is now `benchmarks.X`)`` for a recorded command run by a module since renamed, else ''."""
    match = re.match(r"python -m (\S+)", command)
    module = match and RENAMED.get(match.group(1))
    return f" (that module is now `{module}`)" if module else ""


def provenance_line(run: dict) -> str:
    """One Markdown line that says what :func:`provenance` recorded."""
    return (f"Written by `{run['command']}`{command_note(run['command'])} at commit {run['commit']} (torch {run['torch']}, fairseq "
            f"{run['fairseq']}, Python {run['python']}) on {run['machine']}"
            + (f", {run['threads']} threads" if "threads" in run else "") + f", {run['date']}.")


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name, creating its folder."""
    from moa_tools.textio import atomic_text_outputs

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_text_outputs(path) as (f,):
        f.write(text)


def write_result(out: str, report: dict, text: str) -> None:
    """``out``.json (``report``) and ``out``.md (``text``), ``out`` given with or without ``.json``;
    ``text`` is printed too."""
    out = out[:-5] if out.endswith(".json") else out
    print("\n" + text, flush=True)
    write_atomically(out + ".json", json.dumps(report, indent=1))
    write_atomically(out + ".md", text + "\n")


def sectioned_report(out: str, chosen, every, run: dict) -> dict:
    """The report a run of the sections ``chosen`` (of ``every``) writes to ``out``: a partial run keeps the
    other sections of the file already there; ``report["runs"]`` says which run measured each section."""
    path = out if out.endswith(".json") else out + ".json"
    report = {section: [] for section in every}
    if set(chosen) != set(every) and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            report.update(json.load(f))
    report.setdefault("runs", {}).update({section: run for section in chosen})
    return report


def runs_lines(report: dict) -> str:
    """One line per section of a sectioned report: the run that measured it."""
    return "\n".join(f"- {section}: {provenance_line(run)}" for section, run in report["runs"].items())


def table(header, rows) -> list:
    """A Markdown table's lines: ``header`` names the columns, each row gives their cells (any values)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def study_parser(module: str, doc: str):
    """The command line of ``python -m benchmarks.MODULE``, its help headed by the script's docstring."""
    import argparse

    return argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
