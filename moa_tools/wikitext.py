"""WikiText's tokenised release as plain text for a subword model.

The ``.tokens`` files put a space around every token and mark intra-word
punctuation as ``@-@``, ``@,@`` and ``@.@`` (``1 @,@ 000`` is "1,000"); section
headings are lines such as `` = = Early life = = ``; rare words are ``<unk>``.
:func:`normalise_line` undoes the @-markers, keeps a heading's text without its
``=`` markers, and keeps ``<unk>`` as one symbol (the sentencepiece model treats
it as a user-defined piece, and fairseq's dictionary maps it to its own unk).
Blank lines are dropped: one paragraph or heading per line.
"""

import re
from typing import Iterable, Iterator, Optional

_AT_MARKERS = re.compile(r" @([-,.])@ ")
_HEADING = re.compile(r"^(?:= )+(.*?)(?: =)+$")  # on a stripped line: "= = Early life = ="


def normalise_line(line: str) -> Optional[str]:
    """One ``.tokens`` line -> plain text, or None for a blank line."""
    text = line.strip()
    if not text:
        return None
    heading = _HEADING.match(text)
    if heading:
        text = heading.group(1)
    text = _AT_MARKERS.sub(r"\1", text)
    return text or None


def normalise_lines(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        text = normalise_line(line)
        if text is not None:
            yield text
