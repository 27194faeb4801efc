"""``moh_transformer``: fairseq's Transformer with Mixture-of-Head attention (Jin et al. 2025).

The attention modules named by ``--moh-attention-types`` (default all three) become
:class:`~moa.moh_attention.MixtureOfHeadsAttention` over the arch's own heads: the first
``--moh-shared-heads`` are always active and ``--moh-top-k`` of the rest are routed per token.
Their parameters keep fairseq's ``MultiheadAttention`` names, so a ``transformer`` checkpoint's
weights load into the same shape; the routers add d_model * (heads + 2) per module.

Archs:

* ``moh_base``  ``transformer_wmt_en_de``'s shape (512, FFN 2048, 6+6, 8 heads of 64), 4 shared + top-2
  of 4 routed: 75% of the heads active
* ``moh_small`` the CPU shape of ``moa_small`` (256, FFN 1024, 3+3, 4 heads of 64), 2 shared + top-1 of 2
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture

from moa.models.routed_transformer import (ATTENTION_TYPES, RoutedTransformerModel, add_compile_args, layer_top_k,
                                           parse_attention_types, parse_per_layer, routed_layer_config, routed_layer_counts,
                                           small_translation_shape)
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routing import BALANCE_LOSSES, HEAD_GATE_SCALES, HEAD_ROUTERS, check_head_counts


def add_moh_args(parser):
    """The MoH command-line flags shared by every MoH model."""
    parser.add_argument("--moh-shared-heads", type=int, metavar="H_S",
                        help="heads always active (the first H_S of each module)")
    parser.add_argument("--moh-top-k", type=int, metavar="K", help="routed heads selected per token, of the rest")
    parser.add_argument("--moh-top-k-per-layer", type=str, metavar="LIST",
                        help="routed heads selected per token in each layer, comma-separated, one per layer (e.g. "
                             "1,1,2,2: fewer active heads in shallow layers, as the paper does); replaces "
                             "--moh-top-k in every MoH layer")
    parser.add_argument("--moh-gate-scale", choices=HEAD_GATE_SCALES,
                        help="softmax: the paper's equations, alpha * softmax (default); unit: the released code's "
                             "scaling, 1 for every active head under uniform routers")
    parser.add_argument("--moh-router", choices=HEAD_ROUTERS,
                        help="learned: the paper's two-stage router (default); query-norm: no parameters, a routed "
                             "head's score is the L2 norm of its query and active heads get a gate of 1, with a "
                             "straight-through gradient (the paper's router for converted models, moa-convert-moh)")
    parser.add_argument("--moh-balance-loss", choices=BALANCE_LOSSES,
                        help="paper: L_b = sum_i P_i f_i (default); experts-scaled: E * sum_i P_i f_i, the released code")
    parser.add_argument("--moh-attention-types", type=str, metavar="LIST",
                        help="comma-separated attention types that use MoH, of " + ",".join(ATTENTION_TYPES)
                             + " (default: all); the others are fairseq multi-head attention")
    add_compile_args(parser)


def check_moh_args(args, heads: dict) -> None:
    """Refuse MoH flags that cannot build a model, naming the flag to change. ``heads``: the
    attention heads of each routed attention type."""
    types = parse_attention_types(args.moh_attention_types, "--moh-attention-types")
    per_layer = parse_per_layer(getattr(args, "moh_top_k_per_layer", None), "--moh-top-k-per-layer",
                                routed_layer_counts(args, types))
    flags = [("--moh-top-k", args.moh_top_k)] if per_layer is None else \
        [("--moh-top-k-per-layer", k) for k in per_layer]
    for kind in sorted(types):
        for flag, k in flags:
            h, h_s = heads[kind], args.moh_shared_heads
            try:
                check_head_counts(h, h_s, k)
            except ValueError:
                raise ValueError(f"--moh-shared-heads {h_s} {flag} {k} do not fit the {h} heads of {kind} "
                                 f"attention: MoH needs 0 <= H_S <= heads and 0 <= K <= heads - H_S, with at least "
                                 f"one head active (K = 0, the shared heads only, is an inference setting)") from None


def build_moh_attention(cfg, embed_dim, kind, kdim=None):
    return MixtureOfHeadsAttention(
        embed_dim,
        num_heads=cfg.encoder.attention_heads if kind == "encoder-self" else cfg.decoder.attention_heads,
        shared_heads=cfg.moh_shared_heads,
        top_k=layer_top_k(cfg, cfg.moh_top_k),
        kdim=kdim,
        vdim=kdim,
        dropout=cfg.attention_dropout,
        self_attention=kind != "decoder-cross",
        encoder_decoder_attention=kind == "decoder-cross",
        gate_scale=cfg.moh_gate_scale,
        balance_loss=cfg.moh_balance_loss,
        router=cfg.moh_router,
    )


def moh_layer_config(args):
    """fairseq's layer config for ``args``, building MoH in the attention types that use it."""
    types = parse_attention_types(args.moh_attention_types, "--moh-attention-types")
    per_layer = parse_per_layer(getattr(args, "moh_top_k_per_layer", None), "--moh-top-k-per-layer",
                                routed_layer_counts(args, types))
    return routed_layer_config(args, types, build_moh_attention, per_layer)


@register_model("moh_transformer")
class MoHTransformerModel(RoutedTransformerModel):
    """Transformer encoder-decoder whose attention modules are MoH (Jin et al. 2025)."""

    layer_config = staticmethod(moh_layer_config)

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_moh_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_moh_args(args, {"encoder-self": args.encoder_attention_heads, "decoder-self": args.decoder_attention_heads,
                              "decoder-cross": args.decoder_attention_heads})
        return super().build_model(args, task)



def set_moh_defaults(args, shared_heads, top_k):
    """Fill the MoH flags the user did not give."""
    args.moh_shared_heads = getattr(args, "moh_shared_heads", shared_heads)
    args.moh_top_k = getattr(args, "moh_top_k", top_k)
    args.moh_gate_scale = getattr(args, "moh_gate_scale", "softmax")
    args.moh_balance_loss = getattr(args, "moh_balance_loss", "paper")
    args.moh_router = getattr(args, "moh_router", "learned")
    args.moh_attention_types = getattr(args, "moh_attention_types", ",".join(ATTENTION_TYPES))
    args.moh_top_k_per_layer = getattr(args, "moh_top_k_per_layer", None)


@register_model_architecture("moh_transformer", "moh_transformer")
@register_model_architecture("moh_transformer", "moh_base")
def moh_base(args):
    """MoH on transformer_wmt_en_de's shape: 8 heads of 64, 4 shared + top-2 of 4 (75% active)."""
    set_moh_defaults(args, shared_heads=4, top_k=2)
    base_architecture(args)


@register_model_architecture("moh_transformer", "moh_small")
def moh_small(args):
    """A CPU-sized MoH: d_model 256, FFN 1024, 3+3 layers, 4 heads of 64, 2 shared + top-1 of 2."""
    small_translation_shape(args)
    set_moh_defaults(args, shared_heads=2, top_k=1)
    base_architecture(args)
