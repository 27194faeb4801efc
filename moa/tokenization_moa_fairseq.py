"""The tokenizer of an exported model whose data was sentencepiece-encoded (``moa-export-hf
--sentencepiece-model``): raw text to fairseq's dictionary ids, as the plugin's recipes make them.

Imports sentencepiece and transformers only (it travels with the model). Encoding is the recipes' path:
the sentencepiece model's pieces (``moa-corpus spm-encode``), each looked up in fairseq's ``dict.txt``
(``<unk>`` where absent), ``</s>`` after the sentence (``fairseq-preprocess``); decoding is fairseq's
``--post-process sentencepiece``.
"""

import os
from typing import Dict, List, Optional

import sentencepiece
from transformers import PreTrainedTokenizer

FILES = {"vocab_file": "dict.txt", "sentencepiece_file": "spm.model"}
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's first four ids


class FairseqSentencePieceTokenizer(PreTrainedTokenizer):
    """Sentencepiece pieces looked up in a fairseq dictionary (``dict.txt``: one ``symbol count`` per line,
    after fairseq's four special symbols)."""

    vocab_files_names = FILES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, sentencepiece_file: str, **kwargs):
        self.symbols = list(SPECIALS)
        with open(vocab_file, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line.endswith(" #fairseq:overwrite"):
                    line = line[: -len(" #fairseq:overwrite")]
                self.symbols.append(line.rsplit(" ", 1)[0])
        if kwargs.get("mask_token"):  # a masked LM's: fairseq's masked_lm task adds it after the dictionary
            self.symbols.append(str(kwargs["mask_token"]))
        self.ids = {symbol: i for i, symbol in enumerate(self.symbols)}
        self.vocab_file, self.sentencepiece_file = vocab_file, sentencepiece_file
        self.spm = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_file)
        for name, symbol in (("bos_token", "<s>"), ("pad_token", "<pad>"), ("eos_token", "</s>"), ("unk_token", "<unk>")):
            kwargs.setdefault(name, symbol)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def get_vocab(self) -> Dict[str, int]:
        return dict(self.ids)

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return self.spm.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.ids.get(token, self.ids["<unk>"])

    def _convert_id_to_token(self, index: int) -> str:
        return self.symbols[index]

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        """fairseq's ``--post-process sentencepiece``: pieces joined, ``▁`` made a space, stripped."""
        return "".join(tokens).replace("\u2581", " ").strip()

    def build_inputs_with_special_tokens(self, ids: List[int], pair: Optional[List[int]] = None) -> List[int]:
        return ids + [self.eos_token_id] + ([] if pair is None else pair + [self.eos_token_id])

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None):
        import shutil

        written = []
        for source, name in ((self.vocab_file, FILES["vocab_file"]), (self.sentencepiece_file, FILES["sentencepiece_file"])):
            target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + name)
            if os.path.abspath(source) != os.path.abspath(target):
                shutil.copyfile(source, target)
            written.append(target)
        return tuple(written)
