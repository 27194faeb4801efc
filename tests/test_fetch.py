"""moa-fetch: mirror, verification, resume over HTTP (a loopback server), skip when done."""

import hashlib
import http.server
import os
import threading

import pytest

from moa_tools.commands.fetch import main
from moa_tools.fetch import FetchError, fetch

PAYLOAD = os.urandom(3 * (1 << 20) + 123)
SHA1 = hashlib.sha1(PAYLOAD).hexdigest()


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves PAYLOAD, honours Range, and can cut the first response short."""

    cut_after = None  # bytes of the first full response before the connection drops

    def do_GET(self):  # noqa: N802
        start = 0
        if "Range" in self.headers:
            start = int(self.headers["Range"].split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}")
        else:
            self.send_response(200)
        body = PAYLOAD[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if start == 0 and type(self).cut_after is not None:
            self.wfile.write(body[: type(self).cut_after])
            type(self).cut_after = None
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/archive.zip"
    httpd.shutdown()


def test_interrupted_download_resumes_and_verifies(server, tmp_path):
    dest = str(tmp_path / "archive.zip")
    _RangeHandler.cut_after = 1 << 20
    with pytest.raises(FetchError, match="run the same command again to resume"):
        fetch(server, dest, checksums={"sha1": SHA1})
    assert not os.path.exists(dest) and os.path.getsize(dest + ".part") == 1 << 20
    assert fetch(server, dest, checksums={"sha1": SHA1}).startswith("downloaded")
    assert open(dest, "rb").read() == PAYLOAD and not os.path.exists(dest + ".part")
    assert fetch(server, dest, checksums={"sha1": SHA1}) == "already there"


def test_wrong_checksum_leaves_nothing_behind(server, tmp_path):
    dest = str(tmp_path / "archive.zip")
    assert main([server, dest, "--sha1", "0" * 40]) == 1
    assert not os.path.exists(dest) and not os.path.exists(dest + ".part")


def test_mirror_folder_works_offline_and_truncation_is_an_error(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "archive.zip").write_bytes(PAYLOAD)
    dest = str(tmp_path / "out" / "archive.zip")
    url = "https://unreachable.invalid/path/archive.zip"
    assert fetch(url, dest, checksums={"sha1": SHA1}, mirror=str(mirror)).startswith("copied from")
    (mirror / "archive.zip").write_bytes(PAYLOAD[:1000])
    dest2 = str(tmp_path / "out2" / "archive.zip")
    with pytest.raises(FetchError, match="sha1"):
        fetch(url, dest2, checksums={"sha1": SHA1}, mirror=str(mirror))
    assert not os.path.exists(dest2)
    with pytest.raises(FetchError, match="no archive.zip there"):
        fetch(url, dest2, mirror=str(tmp_path))
