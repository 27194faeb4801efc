"""The parallel-corpus steps of the WMT recipes: archives, SGML test sets, normalisation, filtering.

Lines are read split on ``\\n`` only (:mod:`moa_tools.textio`). Corpora such as Common Crawl carry
``\\r``, U+2028 and other line-break characters inside sentences, and one extra break would shift
every later pair, so :func:`clean_line` turns them into spaces before anything is written.
"""

import os
import re
from multiprocessing import Pool
from typing import List, Sequence, Tuple

from moa_tools import ToolError
from moa_tools.textio import atomic_text_outputs, count_lines, read_lines, write_lines_atomically

_BREAKS = re.compile("[\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_SPACES = re.compile(r"\s+")
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")
_SEG_ID = re.compile(r'<seg[^>]*\bid="?([^">\s]+)"?')
_DOC_ID = re.compile(r'<doc[^>]*\bdocid="([^"]*)"')


class CorpusError(ToolError):
    """A corpus file that cannot be used as it is; the message names the file and the problem."""


def clean_line(text: str) -> str:
    """One line: line-break characters to spaces, runs of whitespace to one space, stripped."""
    return _SPACES.sub(" ", _BREAKS.sub(" ", text)).strip()


def sgm_segments(path: str) -> List[Tuple[str, str, str]]:
    """``(docid, segid, text)`` for every ``<seg>`` of a WMT (pre-2021) SGML file, in file order.

    The text is taken as sacreBLEU takes it: what lies between ``<seg ...>`` and ``</seg>``,
    whitespace collapsed, entities left as they are.
    """
    segments, docid = [], ""
    for number, line in enumerate(read_lines(path), 1):
        if line.startswith("<doc "):
            match = _DOC_ID.search(line)
            docid = match.group(1) if match else ""
        elif line.startswith("<seg "):
            match, seg_id = _SEG.search(line), _SEG_ID.search(line)
            if not match:
                raise CorpusError(f"{path}:{number}: a <seg> without its </seg> on the same line")
            segments.append((docid, seg_id.group(1) if seg_id else str(len(segments) + 1), clean_line(match.group(1))))
    if not segments:
        raise CorpusError(f"{path} has no <seg> lines: not a WMT .sgm file, or an empty one")
    return segments


def extract_sgm_pair(source_sgm: str, reference_sgm: str, source_out: str, reference_out: str) -> int:
    """Write the plain text of a source and a reference ``.sgm``; their documents and segments must align."""
    source, reference = sgm_segments(source_sgm), sgm_segments(reference_sgm)
    if len(source) != len(reference):
        raise CorpusError(f"mismatched test set: {source_sgm} has {len(source)} segments, "
                          f"{reference_sgm} has {len(reference)}")
    for i, (s, r) in enumerate(zip(source, reference)):
        if s[:2] != r[:2]:
            raise CorpusError(f"test set out of step at segment {i + 1}: {source_sgm} has doc {s[0]} seg {s[1]}, "
                              f"{reference_sgm} has doc {r[0]} seg {r[1]}")
    write_lines_atomically(source_out, (s[2] for s in source))
    return write_lines_atomically(reference_out, (r[2] for r in reference))


_normalizer = None


def _init_normalizer(lang: str) -> None:
    global _normalizer
    from sacremoses import MosesPunctNormalizer

    _normalizer = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)


def _normalize(line: str) -> str:
    return clean_line(_normalizer.normalize(clean_line(line)))


def normalize_files(lang: str, inputs: Sequence[str], output: str, workers: int = 1) -> int:
    """Moses punctuation normalisation (with unicode punctuation replaced and control characters
    removed) of ``inputs``, concatenated in order, into ``output``; returns the line count."""
    for path in inputs:
        if not os.path.isfile(path):
            raise CorpusError(f"{path} does not exist")

    def lines():
        for path in inputs:
            yield from read_lines(path)

    if workers <= 1:
        _init_normalizer(lang)
        return write_lines_atomically(output, map(_normalize, lines()))
    with Pool(workers, initializer=_init_normalizer, initargs=(lang,)) as pool:
        return write_lines_atomically(output, pool.imap(_normalize, lines(), chunksize=2000))


def filter_pairs(source_in: str, target_in: str, source_out: str, target_out: str,
                 min_len: int = 1, max_len: int = 250, ratio: float = 1.5) -> Tuple[int, int]:
    """Keep pairs whose sides both have ``min_len..max_len`` tokens (whitespace-separated subword
    pieces) and whose longer side is at most ``ratio`` times the shorter, as Moses'
    clean-corpus-n.perl does. Returns ``(kept, total)``; both outputs are written atomically."""
    total, target_total = count_lines(source_in), count_lines(target_in)
    if target_total != total:
        raise CorpusError(f"mismatched parallel corpora: {source_in} has {total} lines, "
                          f"{target_in} has {target_total}")
    if total == 0:
        raise CorpusError(f"{source_in} and {target_in} are empty: there is nothing to filter; check the step "
                          "that wrote them")
    kept = 0
    with atomic_text_outputs(source_out, target_out) as (s_out, t_out):
        for s, t in zip(read_lines(source_in), read_lines(target_in)):  # streamed: En-Fr has ~36M pairs
            ns, nt = len(s.split()), len(t.split())
            if min_len <= ns <= max_len and min_len <= nt <= max_len and max(ns, nt) <= ratio * min(ns, nt):
                s_out.write(s + "\n")
                t_out.write(t + "\n")
                kept += 1
    return kept, total


def unpack(archive: str, members: Sequence[str], dest_dir: str) -> List[str]:
    """Extract ``members`` of a ``.tgz``/``.tar`` into ``dest_dir`` (flat, by base name; a ``.gz`` member
    is decompressed on the way). The whole archive is read, so a truncated or corrupt one is an error
    (gzip's CRC and tar's framing), and then nothing is left behind. Returns the output paths."""
    import gzip
    import shutil
    import tarfile
    import zlib

    os.makedirs(dest_dir, exist_ok=True)
    wanted, written = set(members), {}
    try:
        with tarfile.open(archive, "r|*") as tar:
            for info in tar:
                if info.name not in wanted or not info.isfile():
                    continue
                name = os.path.basename(info.name)
                out = os.path.join(dest_dir, name[:-3] if name.endswith(".gz") else name)
                with tar.extractfile(info) as member, open(out + ".tmp", "wb") as f:
                    written[info.name] = out
                    shutil.copyfileobj(gzip.GzipFile(fileobj=member) if name.endswith(".gz") else member, f, 1 << 20)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        for out in written.values():
            if os.path.exists(out + ".tmp"):
                os.remove(out + ".tmp")
        raise CorpusError(f"{archive} is truncated or corrupt ({e}); delete it and run again to fetch it afresh") from e
    missing = sorted(wanted - set(written))
    if missing:
        for out in written.values():
            os.remove(out + ".tmp")
        raise CorpusError(f"{archive} lacks {', '.join(missing)}: not the archive this recipe expects")
    for out in written.values():
        os.replace(out + ".tmp", out)
    return [written[m] for m in members]
