"""``moa_lm``: a decoder-only language model with Mixture-of-Attention-heads self-attention.

fairseq's ``transformer_lm`` (:mod:`moa.models.routed_lm`) with
:class:`~moa.moa_attention.MixtureOfAttentionHeads` in every layer: each token picks
``--moa-top-k`` (or ``--moa-top-k-per-layer``) of ``--moa-experts`` query/output experts over one
shared key/value head, so the decoding cache holds one head of width ``--moa-head-dim`` per layer.

Archs:

* ``moa_lm_small``: the CPU shape (256, FFN 1024, 4 layers, tied embeddings), 4K8E64D; twin
  ``transformer_lm_small`` (4 heads of 64). K/V cache: one 64-wide head against four, 1/4.
* ``moa_lm_base``: fairseq's ``transformer_lm`` shape (512, FFN 2048, 6 layers), 8K8E128D as MoA
  Base; twin ``transformer_lm`` (8 heads of 64). K/V cache: one 128-wide head against eight of 64, 1/4.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture

from moa.models.moa_transformer import add_moa_args, check_moa_args, moa_layer_config, set_moa_defaults
from moa.models.routed_lm import RoutedTransformerLanguageModel, decoder_self_only, small_lm_shape


@register_model("moa_lm")
class MoALanguageModel(RoutedTransformerLanguageModel):
    """fairseq's Transformer LM whose self-attention modules are MoA (Zhang et al. 2022)."""

    layer_config = staticmethod(moa_layer_config)

    @staticmethod
    def add_args(parser):
        RoutedTransformerLanguageModel.add_args(parser)
        add_moa_args(parser)

    @classmethod
    def build_model(cls, args, task):
        decoder_self_only(args.moa_attention_types, "--moa-attention-types")
        check_moa_args(args)
        return super().build_model(args, task)


def moa_lm_defaults(args, experts, top_k, head_dim):
    args.moa_attention_types = getattr(args, "moa_attention_types", "decoder-self")
    set_moa_defaults(args, experts=experts, top_k=top_k, head_dim=head_dim)


@register_model_architecture("moa_lm", "moa_lm")
@register_model_architecture("moa_lm", "moa_lm_small")
def moa_lm_small(args):
    """The CPU-sized MoA LM: 256, FFN 1024, 4 layers, 4K8E64D."""
    small_lm_shape(args)
    moa_lm_defaults(args, experts=8, top_k=4, head_dim=64)
    base_lm_architecture(args)


@register_model_architecture("moa_lm", "moa_lm_base")
def moa_lm_base(args):
    """MoA on transformer_lm's shape: 512, FFN 2048, 6 layers, 8K8E128D."""
    moa_lm_defaults(args, experts=8, top_k=8, head_dim=128)
    base_lm_architecture(args)
