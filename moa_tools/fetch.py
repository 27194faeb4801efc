"""Downloading one file for a recipe: progress, resume, verification, an offline mirror.

* DEST already there and verified: nothing to do (a finished step is skipped).
* A mirror folder holding a file named like the URL's last part: copied from there, no network
  (the whole recipe then runs offline).
* Otherwise downloaded to ``DEST.part`` with progress on stderr; an interrupted download resumes
  from ``DEST.part`` (HTTP Range); the file is verified (the size the server announced or the one
  given, and the checksums given) and only then renamed to DEST. A truncated or corrupt file is an
  error and never becomes DEST.
"""

import hashlib
import os
import shutil
import sys
import time
import urllib.error
import urllib.request

from moa_tools import ToolError

CHUNK = 1 << 20


class FetchError(ToolError):
    """A download that failed or a file that does not verify; the message says what to do."""


def file_digest(path: str, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: str, size=None, checksums=None) -> None:
    """Raise FetchError naming what is wrong unless ``path`` has the given size and checksums."""
    actual = os.path.getsize(path)
    if size is not None and actual != size:
        raise FetchError(f"{path}: {actual} bytes, expected {size} (truncated or wrong file)")
    for algorithm, expected in (checksums or {}).items():
        got = file_digest(path, algorithm)
        if got != expected.lower():
            raise FetchError(f"{path}: {algorithm} {got}, expected {expected} (corrupt or wrong file)")


def _progress(done: int, total, started: float) -> None:
    rate = done / max(time.time() - started, 1e-6) / 2 ** 20
    where = f"{done / 2 ** 20:.1f} MiB" + (f" of {total / 2 ** 20:.1f} MiB ({100 * done / total:.0f}%)" if total else "")
    print(f"\r  {where}, {rate:.1f} MiB/s", end="", file=sys.stderr, flush=True)


def download(url: str, part: str, timeout: float = 60.0):
    """Download ``url`` into ``part``, resuming it if it exists; returns the total size if known."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to fetch: the part file is complete
            return have
        raise FetchError(f"{url}: HTTP {e.code} {e.reason}; give another address or --mirror DIR") from e
    except urllib.error.URLError as e:
        raise FetchError(f"{url}: {e.reason}; without a network, pass --mirror DIR holding the file") from e
    with response:
        resumed = response.status == 206
        length = response.headers.get("Content-Length")
        total = (int(length) + (have if resumed else 0)) if length is not None else None
        if have and not resumed:
            have = 0  # the server ignored Range: start over
        print(f"{'resuming' if resumed else 'downloading'} {url}", file=sys.stderr)
        started = time.time()
        with open(part, "ab" if resumed else "wb") as out:
            done = have
            for block in iter(lambda: response.read(CHUNK), b""):
                out.write(block)
                done += len(block)
                _progress(done, total, started)
        print(file=sys.stderr)
    return total


def fetch(url: str, dest: str, size=None, checksums=None, mirror=None) -> str:
    """Make ``dest`` a verified copy of ``url`` (see the module docstring); returns how."""
    if os.path.exists(dest):
        verify(dest, size, checksums)
        return "already there"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    if mirror:
        source = os.path.join(mirror, os.path.basename(url.rstrip("/")))
        if not os.path.exists(source):
            raise FetchError(f"--mirror {mirror}: no {os.path.basename(source)} there")
        shutil.copyfile(source, part)
        how = f"copied from {source}"
    else:
        total = download(url, part)
        if size is None and total is not None:
            size = total
        how = f"downloaded from {url}"
    try:
        verify(part, size, checksums)
    except FetchError as e:
        if mirror or size is None or os.path.getsize(part) >= size:
            os.remove(part)  # complete but wrong: resuming cannot mend it
            raise
        raise FetchError(f"{e}; run the same command again to resume the download") from e
    os.replace(part, dest)
    return how
