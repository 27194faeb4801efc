"""Reading text files line by line, and writing them so that an interrupted step leaves nothing.

Lines are split on ``\\n`` only: Python's universal newlines (and fairseq's own readers) would also
break at ``\\r``, and ``str.splitlines`` at U+2028 and friends, which corpora such as Common Crawl
carry inside sentences. Text must be UTF-8: a byte sequence that is not stops the reading with a
:class:`NotUTF8Error` naming the file, the line and the fix, and whatever the step was writing is
removed.
"""

import os
from contextlib import ExitStack, contextmanager
from typing import IO, Iterable, Iterator, List

from moa_tools import ToolError


class NotUTF8Error(ToolError):
    """A text input that is not UTF-8."""


def read_lines(path: str) -> Iterator[str]:
    """The lines of a UTF-8 file, split on ``\\n`` only; raises :class:`NotUTF8Error` at the first
    line that does not decode."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise NotUTF8Error(
                    f"{path}: line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line); "
                    f"convert the file to UTF-8 first (e.g. iconv -f LATIN1 -t UTF-8 {path}), or remove the line"
                ) from None
            yield line[:-1] if line.endswith("\n") else line


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


@contextmanager
def atomic_text_outputs(*paths: str) -> Iterator[List[IO[str]]]:
    """Open each of ``paths`` for writing (UTF-8) under a ``.tmp`` name and yield the files.

    When the block finishes, every file is renamed into place; if it raises (a bad path, a full disk,
    an interrupt), every ``.tmp`` file is removed and an existing output is left as it was."""
    temps = [path + ".tmp" for path in paths]
    try:
        with ExitStack() as stack:
            files = [stack.enter_context(open(temp, "w", encoding="utf-8")) for temp in temps]
            yield files
            for f in files:  # the data on the disk before the rename publishes it
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for temp in temps:
            if os.path.exists(temp):
                os.remove(temp)
        raise
    for temp, path in zip(temps, paths):
        os.replace(temp, path)


def write_lines_atomically(path: str, lines: Iterable[str]) -> int:
    """Write ``lines`` to ``path`` through a temporary name; returns how many were written."""
    count = 0
    with atomic_text_outputs(path) as (out,):
        for line in lines:
            out.write(line + "\n")
            count += 1
    return count
