"""Joint sentencepiece models for the recipes: train on plain text, encode files atomically."""

import os
from contextlib import ExitStack, contextmanager
from typing import IO, Iterable, Iterator, List, Sequence

import sentencepiece as spm


@contextmanager
def atomic_text_outputs(*paths: str) -> Iterator[List[IO[str]]]:
    """Open each of ``paths`` for writing (UTF-8) under a ``.tmp`` name and yield the files.

    When the block finishes, every file is renamed into place; if it raises (a bad path, a full disk,
    an interrupt), every ``.tmp`` file is removed and an existing output is left as it was."""
    temps = [path + ".tmp" for path in paths]
    try:
        with ExitStack() as stack:
            yield [stack.enter_context(open(temp, "w", encoding="utf-8")) for temp in temps]
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


def train_sentencepiece(inputs: Sequence[str], prefix: str, vocab_size: int, **options) -> str:
    """Train a BPE sentencepiece model on ``inputs`` unless ``prefix.model`` exists; returns its path."""
    if not os.path.exists(prefix + ".model"):
        spm.SentencePieceTrainer.train(
            input=",".join(inputs), model_prefix=prefix + ".tmp", vocab_size=vocab_size, model_type="bpe",
            character_coverage=1.0, bos_id=-1, eos_id=-1, minloglevel=2, **options)
        os.replace(prefix + ".tmp.vocab", prefix + ".vocab")
        os.replace(prefix + ".tmp.model", prefix + ".model")
    return prefix + ".model"


def encode_file(model_file: str, source: str, target: str) -> int:
    """Write ``source``'s lines as space-separated pieces to ``target`` (kept if already there)."""
    if os.path.exists(target):
        with open(target, encoding="utf-8", newline="\n") as f:
            return sum(1 for _ in f)
    model = spm.SentencePieceProcessor(model_file=model_file)
    with open(source, encoding="utf-8", newline="\n") as f:  # split on \n only, as moa.data.parallel writes
        return write_lines_atomically(target, (" ".join(model.encode(line.rstrip("\n"), out_type=str)) for line in f))
