"""Command-line tools installed as console scripts by setup.py, and what they share."""

import os
import sys

import moa

USER_DIR = os.path.dirname(os.path.abspath(moa.__file__))  # the folder to pass as fairseq's --user-dir


def cli(name: str) -> str:
    """The path of a console script installed beside this Python (fairseq-train, ...)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name
