"""``moh_lm``: a decoder-only language model with Mixture-of-Head self-attention (Jin et al. 2025).

fairseq's ``transformer_lm`` (:mod:`moa.models.routed_lm`) with
:class:`~moa.moh_attention.MixtureOfHeadsAttention` in every layer: the first ``--moh-shared-heads``
heads always active, ``--moh-top-k`` (or ``--moh-top-k-per-layer``) of the rest routed per token.
MoH keeps fairseq's attention parameter names, so ``moa-convert-moh`` turns a trained
``transformer_lm`` checkpoint into this model.

Archs:

* ``moh_lm_small``: the CPU shape (256, FFN 1024, 4 layers, 4 heads of 64, tied embeddings), 2
  shared + top-1 of 2 (75% of the heads); twin ``transformer_lm_small``. 50% of the heads:
  ``--moh-shared-heads 1 --moh-top-k 1``.
* ``moh_lm_base``: the shape of fairseq's ``transformer_lm_gpt`` (768, FFN 3072, 12 layers, 12 heads
  of 64, GELU), the 12-layer, 768-wide shape taken for the MoH paper's LLM-S (the paper gives only
  its 186M parameters); 6 shared + top-3 of 6 (75%); twin ``transformer_lm_gpt``. 50%:
  ``--moh-shared-heads 3 --moh-top-k 3``.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture, transformer_lm_gpt

from moa.models.moh_transformer import add_moh_args, check_moh_args, moh_layer_config, set_moh_defaults
from moa.models.routed_lm import RoutedTransformerLanguageModel, decoder_self_only, small_lm_shape


@register_model("moh_lm")
class MoHLanguageModel(RoutedTransformerLanguageModel):
    """fairseq's Transformer LM whose self-attention modules are MoH."""

    layer_config = staticmethod(moh_layer_config)

    @staticmethod
    def add_args(parser):
        RoutedTransformerLanguageModel.add_args(parser)
        add_moh_args(parser)

    @classmethod
    def build_model(cls, args, task):
        decoder_self_only(args.moh_attention_types, "--moh-attention-types")
        check_moh_args(args, {"decoder-self": args.decoder_attention_heads})
        return super().build_model(args, task)


def moh_lm_defaults(args, shared_heads, top_k):
    args.moh_attention_types = getattr(args, "moh_attention_types", "decoder-self")
    set_moh_defaults(args, shared_heads=shared_heads, top_k=top_k)


@register_model_architecture("moh_lm", "moh_lm")
@register_model_architecture("moh_lm", "moh_lm_small")
def moh_lm_small(args):
    """The CPU-sized MoH LM: 256, FFN 1024, 4 layers, 4 heads of 64; 2 shared + top-1 of 2."""
    small_lm_shape(args)
    moh_lm_defaults(args, shared_heads=2, top_k=1)
    base_lm_architecture(args)


@register_model_architecture("moh_lm", "moh_lm_base")
def moh_lm_base(args):
    """MoH on transformer_lm_gpt's shape: 768, FFN 3072, 12 layers, 12 heads of 64; 6 shared + top-3 of 6."""
    moh_lm_defaults(args, shared_heads=6, top_k=3)
    transformer_lm_gpt(args)
