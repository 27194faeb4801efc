"""The plugin's named input errors end a program as one line, not as a traceback through fairseq.

An uncaught :class:`NamedInputError` (a damaged checkpoint or data-bin, a dictionary that is not the data's)
raised inside fairseq-train, fairseq-generate, fairseq-eval-lm or a ``moa-*`` tool prints
``PROGRAM: error: MESSAGE`` on stderr and exits with status 1, and so do fairseq's own errors for a missing
input, which name it (``Model file not found: X``, ``Dataset not found: SPLIT (DIR)``); every other
exception keeps Python's traceback.
"""

import os
import sys

MISSING_INPUT = ("Model file not found:", "Dataset not found:")  # fairseq's messages for a missing input


class NamedInputError(Exception):
    """An input the program cannot use, whose message names the file, what is wrong and the fix."""


def printing_named_errors(excepthook):
    """``sys.excepthook`` that prints named input errors as one line and hands the rest to ``excepthook``."""

    def hook(kind, error, traceback):
        if isinstance(error, NamedInputError) or (isinstance(error, OSError) and str(error).startswith(MISSING_INPUT)):
            print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {error}", file=sys.stderr)
            return
        excepthook(kind, error, traceback)

    return hook
