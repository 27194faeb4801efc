"""Python use of a trained MoA or MoH translation model (any arch of this plugin), through fairseq's hub interface.

    import moa.hub
    translator = moa.hub.load_translator("checkpoints/checkpoint_best.pt", "data-bin",
                                         sentencepiece_model="spm/spm.model")
    translator.translate("A man is riding a bike.", beam=4)          # -> str
    translator.translate(["Two dogs play.", "A red car."], beam=4)    # -> list of str

The result is fairseq's ``GeneratorHubInterface`` (``translate``, ``sample``,
``encode``/``decode``, ``generate``), loaded through torch's safe loader with
the plugin's allow-list.
"""

import os
from typing import Optional

from moa.models.moa_transformer import MoATransformerModel


def load_translator(checkpoint: str, data_bin: str, sentencepiece_model: Optional[str] = None, **overrides):
    """A ``GeneratorHubInterface`` for ``checkpoint`` with the dictionaries of ``data_bin``.

    With ``sentencepiece_model`` the interface encodes raw text and decodes to raw text;
    without it, input must already be in the model's pieces. ``overrides`` go to fairseq
    (e.g. ``cpu=True``, ``source_lang="en"``).
    """
    for path in (checkpoint, data_bin) + ((sentencepiece_model,) if sentencepiece_model else ()):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} does not exist")
    folder, name = os.path.split(os.path.abspath(checkpoint))
    if sentencepiece_model:
        import sentencepiece

        try:
            sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{sentencepiece_model} is not a sentencepiece model ({str(e).strip()}): give the "
                             "spm.model the data was encoded with (the recipe writes OUT/spm/spm.model)") from None
        overrides = dict(bpe="sentencepiece", sentencepiece_model=os.path.abspath(sentencepiece_model), **overrides)
    return MoATransformerModel.from_pretrained(folder, checkpoint_file=name, data_name_or_path=os.path.abspath(data_bin),
                                               **overrides)
