"""Corpus steps write through temporary names: a failure leaves no ``.tmp`` file and no changed output."""

import os
import subprocess
import sys

import pytest

from moa.data.subword import write_lines_atomically

CORPUS = [os.path.join(os.path.dirname(sys.executable), "moa-corpus")]


def test_filter_that_cannot_write_its_second_output_leaves_nothing_behind(tmp_path):
    (tmp_path / "in.en").write_text("a b\nc d e\n", encoding="utf-8")
    (tmp_path / "in.de").write_text("x y\nz w v\n", encoding="utf-8")
    previous = tmp_path / "train.en"
    previous.write_text("from an earlier run\n", encoding="utf-8")
    missing = tmp_path / "no-such-dir" / "train.de"
    proc = subprocess.run(CORPUS + ["filter", str(tmp_path / "in.en"), str(tmp_path / "in.de"), str(previous),
                                    str(missing)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "moa-corpus: error:" in proc.stderr and "no-such-dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert previous.read_text(encoding="utf-8") == "from an earlier run\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_filter_writes_both_outputs_when_it_succeeds(tmp_path):
    (tmp_path / "in.en").write_text("a b\nc d e\none two three four five\n", encoding="utf-8")
    (tmp_path / "in.de").write_text("x y\nz w v\nok\n", encoding="utf-8")
    proc = subprocess.run(CORPUS + ["filter", str(tmp_path / "in.en"), str(tmp_path / "in.de"),
                                    str(tmp_path / "out.en"), str(tmp_path / "out.de")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "kept 2 of 3 pairs" in proc.stderr
    assert (tmp_path / "out.en").read_text(encoding="utf-8") == "a b\nc d e\n"
    assert (tmp_path / "out.de").read_text(encoding="utf-8") == "x y\nz w v\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failure_midway_through_the_lines_keeps_the_old_file(tmp_path):
    path = tmp_path / "train.en"
    path.write_text("old\n", encoding="utf-8")

    def lines():
        yield "first"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_lines_atomically(str(path), lines())
    assert path.read_text(encoding="utf-8") == "old\n" and not list(tmp_path.glob("*.tmp"))
    assert write_lines_atomically(str(path), ["new", "lines"]) == 2
    assert path.read_text(encoding="utf-8") == "new\nlines\n"
