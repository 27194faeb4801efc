"""Running Python where fairseq and moa cannot be imported: what a user of an exported model has."""

import subprocess
import sys

# prepended to a script: any import of fairseq, moa or moa_tools raises ImportError
WITHOUT_FAIRSEQ = r'''
import importlib.abc, sys

class Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("fairseq", "moa", "moa_tools"):
            raise ImportError(f"{name}: not installed in this process")

sys.meta_path.insert(0, Unimportable())
'''


def run_without_fairseq(script: str, *args: str, cwd: str) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` in ``cwd`` with fairseq, moa and moa_tools unimportable (output captured)."""
    return subprocess.run([sys.executable, "-c", WITHOUT_FAIRSEQ + script, *args], capture_output=True, text=True,
                          cwd=cwd)
