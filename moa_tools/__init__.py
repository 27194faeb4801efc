"""The moa toolkit's data preparation, scoring and checkpoint tools (the ``moa-*`` console scripts).

The plugin itself is the ``moa`` package (``fairseq-train --user-dir moa``); this package sits
beside it and never imports torch or fairseq at import time, so the text tools start at once.
What every tool shares lives here:

* :data:`USER_DIR`, the folder to pass as fairseq's ``--user-dir``, found without importing it;
* :func:`fairseq_command`, the path of a console script installed beside this Python;
* :func:`require_subset`, the check that a data-bin holds a subset, listing the ones it holds;
* the error convention: a tool raises :class:`ToolError` (or lets an ``OSError`` through) with a
  message that names the problem and the fix; :func:`run_tool` prints it as
  ``PROG: error: MESSAGE`` (argparse's own format) and returns exit code 1.
"""

import importlib.util
import os
import subprocess
import sys
from typing import Callable, Optional, Sequence

USER_DIR = os.path.dirname(importlib.util.find_spec("moa").origin)


class ToolError(RuntimeError):
    """An input a tool cannot use, or a step that failed; the message names what to fix."""


def run_tool(prog: str, main: Callable[[Optional[Sequence[str]]], Optional[int]], argv=None) -> int:
    """Run ``main(argv)`` under the tools' error convention; returns the exit code."""
    try:
        return main(argv) or 0
    except (ToolError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


def require_subset(data_bin: str, subset: str, choose: str = "a subset") -> None:
    """Raise :class:`ToolError` unless ``data_bin`` is a folder holding ``subset`` (``SUBSET.bin``,
    or ``SUBSET.SRC-TGT.LANG.bin`` for translation); the message lists the subsets it holds."""
    import glob

    if not os.path.isdir(data_bin):
        raise ToolError(f"DATA-BIN {data_bin} is not a folder (give the fairseq-preprocess output the model was "
                        "trained on)")
    if not glob.glob(os.path.join(data_bin, f"{subset}.bin")) + glob.glob(os.path.join(data_bin, f"{subset}.*.bin")):
        found = sorted({os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(data_bin, "*.bin"))})
        raise ToolError(f"{data_bin} holds no {subset!r} subset; choose {choose} from: {', '.join(found) or 'none'}")


def fairseq_command(name: str) -> str:
    """The path of a console script installed beside this Python (``fairseq-train``, ...)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def run_logged(cmd: Sequence[str], log_path: Optional[str] = None,
               on_line: Optional[Callable[[str], None]] = None) -> str:
    """Run ``cmd`` with this Python's scripts first on PATH and return its output (stdout and stderr).

    With ``log_path`` the output goes to that file as it is written (``tail -f`` shows progress),
    and ``on_line`` is called with each line as it arrives. A non-zero exit is a
    :class:`ToolError` carrying the output's tail."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if log_path is None:
        proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        code, output = proc.returncode, proc.stdout
    else:
        with open(log_path, "w", encoding="utf-8") as log:
            with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  errors="replace") as proc:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if on_line is not None:
                        on_line(line)
            code = proc.returncode
        with open(log_path, encoding="utf-8", errors="replace") as log:
            output = log.read()
    if code != 0:
        where = f"; the end of {log_path}" if log_path else ""
        raise ToolError(f"{os.path.basename(cmd[0])} failed with exit code {code}{where}:\n{output[-3000:]}")
    return output
