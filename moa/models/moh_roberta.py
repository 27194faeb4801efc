"""``moh_roberta``: a RoBERTa-style masked-LM encoder whose self-attention is MoH.

It subclasses fairseq's ``RobertaModel``/``RobertaEncoder`` and swaps only the sentence encoder for
:class:`~moa.models.routed_transformer.RoutedTransformerEncoder` with
:class:`~moa.moh_attention.MixtureOfHeadsAttention`, so fairseq's ``masked_lm`` task, LM head and
hub tools apply unchanged. Train it with ``--task masked_lm --criterion moa_masked_lm``. Every MoH
parameter is an ``nn.Linear``, so BERT's initialisation (normal, std 0.02) covers the routers too.

Archs: ``moh_roberta_base`` (RoBERTa-base: 768, FFN 3072, 12 layers, 12 heads of 64; 6 shared +
top-3 of 6, 75% active) and ``moh_roberta_small`` (the CPU shape of ``moa_roberta_small``: 256,
FFN 1024, 4 layers, 4 heads of 64; 2 shared + top-1 of 2).
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta.model import RobertaEncoder, RobertaModel
from fairseq.models.roberta.model import base_architecture as roberta_base_architecture
from fairseq.modules.transformer_sentence_encoder import init_bert_params

from moa.models.moh_transformer import add_moh_args, check_moh_args, moh_layer_config, set_moh_defaults
from moa.models.routed_transformer import (RoutedModel, RoutedTransformerEncoder, add_activation_checkpointing_args,
                                           small_roberta_shape)


class MoHRobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = RoutedTransformerEncoder(moh_layer_config(args), dictionary, embed_tokens)
        encoder.apply(init_bert_params)
        return encoder


@register_model("moh_roberta")
class MoHRobertaModel(RoutedModel, RobertaModel):
    """RoBERTa whose encoder self-attention modules are MoH (Jin et al. 2025)."""

    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        add_activation_checkpointing_args(parser)
        add_moh_args(parser)

    @classmethod
    def build_model(cls, args, task):
        if "decoder" in args.moh_attention_types:
            raise ValueError("--moh-attention-types: a masked LM has only encoder-self attention")
        check_moh_args(args, {"encoder-self": args.encoder_attention_heads})
        if not hasattr(args, "max_positions"):
            args.max_positions = getattr(args, "tokens_per_sample", None) or task.max_positions()
        return cls(args, MoHRobertaEncoder(args, task.source_dictionary))


@register_model_architecture("moh_roberta", "moh_roberta")
@register_model_architecture("moh_roberta", "moh_roberta_base")
def moh_roberta_base(args):
    """RoBERTa-base with MoH self-attention: 12 heads, 6 shared + top-3 of 6."""
    args.moh_attention_types = getattr(args, "moh_attention_types", "encoder-self")
    set_moh_defaults(args, shared_heads=6, top_k=3)
    roberta_base_architecture(args)


@register_model_architecture("moh_roberta", "moh_roberta_small")
def moh_roberta_small(args):
    """A CPU-sized MoH masked LM: d_model 256, FFN 1024, 4 layers, 4 heads of 64, 2 shared + top-1 of 2."""
    small_roberta_shape(args)
    args.moh_attention_types = getattr(args, "moh_attention_types", "encoder-self")
    set_moh_defaults(args, shared_heads=2, top_k=1)
    roberta_base_architecture(args)
