"""Writing files so that a reader (or a resumed run) sees either the old file or the whole new one.

The plugin's checkpoint code and the command-line tools (``moa_tools``) both write through these:
a temporary name beside the target, flushed to disk, then renamed into place.
"""

import os
import shutil
from contextlib import contextmanager
from typing import Iterator


def fsync_file(path: str) -> None:
    """Flush a written file's data to the disk, so that renaming it into place publishes whole data
    even after a crash of the machine."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_file(path: str) -> Iterator[str]:
    """Yield ``path.tmp`` to write; when the block finishes, flush it to disk and rename it to ``path``.
    If the block raises, the temporary file is removed and ``path`` is left as it was."""
    temporary = path + ".tmp"
    try:
        yield temporary
        fsync_file(temporary)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    os.replace(temporary, path)


def atomic_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` so that ``dst`` is always either its old content or the whole copy."""
    with atomic_file(dst) as temporary:
        shutil.copyfile(src, temporary)
