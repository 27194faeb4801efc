"""``python slow_saves.py TOOL ARGS``: the console script TOOL (fairseq-train, moa-average-checkpoints,
...) with slow file writes, so that a test's kills land inside its saves. torch.save and file copies
write in pieces (8 KiB, or ``SLOW_SAVES_PIECE`` bytes) with a pause after each; the bytes written are
the same."""

import io
import os
import shutil
import sys
import time

import torch

PIECE, PAUSE = int(os.environ.get("SLOW_SAVES_PIECE", 8192)), 0.002
_torch_save = torch.save


def slow_save(obj, f, *args, **kwargs):
    if isinstance(f, (str, bytes)) or not hasattr(f, "write"):
        with open(f, "wb") as handle:
            return slow_save(obj, handle, *args, **kwargs)
    buffer = io.BytesIO()
    _torch_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    for start in range(0, len(data), PIECE):
        f.write(data[start:start + PIECE])
        f.flush()
        time.sleep(PAUSE)


def slow_copyfile(src, dst, *, follow_symlinks=True):
    with open(src, "rb") as source, open(dst, "wb") as target:
        while True:
            piece = source.read(PIECE)
            if not piece:
                return dst
            target.write(piece)
            target.flush()
            time.sleep(PAUSE)


torch.save = slow_save
shutil.copyfile = slow_copyfile

if __name__ == "__main__":
    from importlib.metadata import entry_points

    tool = sys.argv[1]
    (entry,) = entry_points(group="console_scripts", name=tool)
    sys.argv = [tool, *sys.argv[2:]]
    sys.exit(entry.load()())
