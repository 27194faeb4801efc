"""Joint BPE sentencepiece models for the recipes: train on plain text, encode files atomically."""

import os
from typing import Sequence

from moa_tools import ToolError
from moa_tools.textio import read_lines, write_lines_atomically


def load_sentencepiece(model_file: str):
    """The sentencepiece model in ``model_file``; :class:`ToolError` naming the file and the fix when it is
    not one (truncated, or another file in its place)."""
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
        raise ToolError(f"{model_file} is not a sentencepiece model ({str(e).strip() or type(e).__name__}): delete it "
                        "and run the preparation again, which trains a new one (or give the model the data was "
                        "encoded with)") from None


def train_sentencepiece(inputs: Sequence[str], prefix: str, vocab_size: int, input_sentence_size: int = 0,
                        keep_symbols: Sequence[str] = ()) -> str:
    """Train a BPE sentencepiece model on ``inputs`` unless ``prefix.model`` exists; returns its path.

    ``input_sentence_size``: learn from that many randomly sampled lines (0: all of them).
    ``keep_symbols``: strings kept as one piece each, never split; keeping ``<unk>`` (WikiText's rare-word
    marker) renames sentencepiece's own unknown piece to ``<spm-unk>``.
    """
    import sentencepiece as spm

    if os.path.exists(prefix + ".model"):
        load_sentencepiece(prefix + ".model")  # a model left by an earlier run must be a whole one
        return prefix + ".model"
    options = dict(input_sentence_size=input_sentence_size, shuffle_input_sentence=True) if input_sentence_size else {}
    if keep_symbols:
        options["user_defined_symbols"] = list(keep_symbols)
        if "<unk>" in keep_symbols:
            options["unk_piece"] = "<spm-unk>"
    spm.SentencePieceTrainer.train(
        input=",".join(inputs), model_prefix=prefix + ".tmp", vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, bos_id=-1, eos_id=-1, minloglevel=2, **options)
    os.replace(prefix + ".tmp.vocab", prefix + ".vocab")
    os.replace(prefix + ".tmp.model", prefix + ".model")
    return prefix + ".model"


def encode_file(model_file: str, source: str, target: str) -> int:
    """Write ``source``'s lines as space-separated pieces to ``target`` (kept if already there)."""
    if os.path.exists(target):
        return sum(1 for _ in read_lines(target))
    model = load_sentencepiece(model_file)
    return write_lines_atomically(target, (" ".join(model.encode(line, out_type=str)) for line in read_lines(source)))
