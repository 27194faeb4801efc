"""Decoder-only language models with routed self-attention, on fairseq's ``transformer_lm``.

:class:`RoutedTransformerLanguageModel` is fairseq's ``TransformerLanguageModel`` (its flags, its
embeddings, adaptive input and softmax, its ``language_modeling`` task, ``fairseq-eval-lm`` and
sampling) with the routed decoder of :mod:`moa.models.routed_transformer` and no encoder attention:
MoA or MoH in every layer's self-attention. A subclass says which through ``layer_config(args)``.

Train with ``--task language_modeling --criterion moa_cross_entropy`` (the routers' auxiliary
losses join fairseq's cross-entropy there).

The same-shape Transformer of the CPU archs is ``transformer_lm_small``, registered here on
fairseq's own ``transformer_lm`` model: d_model 256, FFN 1024, 4 layers, 4 heads of 64, tied input
and output embeddings.
"""

import logging

from fairseq.models import register_model_architecture
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from moa.models.routed_transformer import RoutedModel, RoutedTransformerDecoder

logger = logging.getLogger(__name__)


class RoutedTransformerLanguageModel(RoutedModel, TransformerLanguageModel):
    """fairseq's ``TransformerLanguageModel`` whose decoder is the routed one."""

    layer_config = None  # staticmethod(args) -> a routed_layer_config, set by the subclass

    @staticmethod
    def add_args(parser):
        TransformerLanguageModel.add_args(parser)  # the flags of fairseq's transformer_lm config

    @classmethod
    def build_model(cls, args, task):
        """fairseq builds the token embeddings (plain, adaptive input or character) as for
        ``transformer_lm``, with its layer count set to 0 for that call; the routed decoder then
        takes those embeddings and builds the layers."""
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        layers, keep = args.decoder_layers, args.decoder_layers_to_keep
        args.decoder_layers, args.decoder_layers_to_keep = 0, None
        try:
            embeddings_only = TransformerLanguageModel.build_model(args, task)
        finally:
            args.decoder_layers, args.decoder_layers_to_keep = layers, keep
        decoder = RoutedTransformerDecoder(cls.layer_config(args), task.target_dictionary,
                                           embeddings_only.decoder.embed_tokens, no_encoder_attn=True)
        model = cls(decoder)
        logger.info(model.describe_active_share())
        return model


def small_lm_shape(args) -> None:
    """The CPU shape of the small LM archs: d_model 256, FFN 1024, 4 layers, 4 heads, dropout 0.1,
    attention dropout 0.1, tied input and output embeddings (flags the user gave win)."""
    for name, value in (("decoder_embed_dim", 256), ("decoder_ffn_embed_dim", 1024), ("decoder_layers", 4),
                        ("decoder_attention_heads", 4), ("dropout", 0.1), ("attention_dropout", 0.1),
                        ("share_decoder_input_output_embed", True)):
        setattr(args, name, getattr(args, name, value))


def decoder_self_only(types: str, flag: str) -> None:
    """Refuse attention types other than decoder-self: the only attention a language model has."""
    if {t.strip() for t in str(types).split(",") if t.strip()} != {"decoder-self"}:
        raise ValueError(f"{flag} {types}: a language model has only decoder-self attention")


@register_model_architecture("transformer_lm", "transformer_lm_small")
def transformer_lm_small(args):
    """fairseq's transformer_lm at the CPU shape of moa_lm_small and moh_lm_small."""
    small_lm_shape(args)
    base_lm_architecture(args)
