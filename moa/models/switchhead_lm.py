"""``switchhead_lm``: a decoder-only language model with SwitchHead self-attention (Csordas et al. 2024).

fairseq's ``transformer_lm`` (:mod:`moa.models.routed_lm`) with
:class:`~moa.switchhead_attention.SwitchHeadAttention` in every layer. The decoding cache holds
``--switchhead-heads`` heads of keys and mixed values per layer.

Archs:

* ``switchhead_lm_small``: the CPU shape (256, FFN 1024, 4 layers, tied embeddings), 2H2K4E56D (the
  configuration of ``switchhead_small``); twin ``transformer_lm_small`` (4 heads of 64). K/V cache: two
  56-wide heads against four of 64, 7/16.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture

from moa.models.routed_lm import RoutedTransformerLanguageModel, decoder_self_only, small_lm_shape
from moa.models.switchhead_transformer import (add_switchhead_args, check_switchhead_args, set_switchhead_defaults,
                                               switchhead_layer_config)


@register_model("switchhead_lm")
class SwitchHeadLanguageModel(RoutedTransformerLanguageModel):
    """fairseq's Transformer LM whose self-attention modules are SwitchHead."""

    layer_config = staticmethod(switchhead_layer_config)

    @staticmethod
    def add_args(parser):
        RoutedTransformerLanguageModel.add_args(parser)
        add_switchhead_args(parser)

    @classmethod
    def build_model(cls, args, task):
        decoder_self_only(args.switchhead_attention_types, "--switchhead-attention-types")
        check_switchhead_args(args)
        return super().build_model(args, task)


@register_model_architecture("switchhead_lm", "switchhead_lm")
@register_model_architecture("switchhead_lm", "switchhead_lm_small")
def switchhead_lm_small(args):
    """The CPU-sized SwitchHead LM: 256, FFN 1024, 4 layers, 2H2K4E56D."""
    small_lm_shape(args)
    args.switchhead_attention_types = getattr(args, "switchhead_attention_types", "decoder-self")
    set_switchhead_defaults(args, heads=2, top_k=2, experts=4, head_dim=56)
    base_lm_architecture(args)
