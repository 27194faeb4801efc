"""``moa_transformer``: fairseq's Transformer with Mixture-of-Attention-heads layers.

The model subclasses fairseq's ``TransformerModel``; its encoder and decoder are the routed ones of
:mod:`moa.models.routed_transformer`, building :class:`~moa.moa_attention.MixtureOfAttentionHeads` in
the attention types ``--moa-attention-types`` names.

Archs (all d_model 512, FFN 2048, 6+6 layers except ``moa_small``):

* ``moa_base``  8K8E128D with the authors' dropouts (0.2 / attention 0.2 / activation 0.1)
* ``moa_big``   16K32E256D, same shape and dropouts
* ``moa_small`` d_model 256, FFN 1024, 3+3 layers, 4K8E64D: for CPUs and tests

``--moa-experts``, ``--moa-top-k``, ``--moa-head-dim``, ``--moa-gate-weights``,
``--moa-attention-types`` and ``--moa-attention-bias`` override any arch. Where the authors'
released code departs from the paper (raw gate weights, the auxiliary losses added once per batch)
or fills in what the paper leaves open (a zero-initialised router), ``--moa-gate-weights``,
``--moa-router-init`` and the criterion's ``--moa-aux-loss-scale`` choose, and ``--moa-released-code``
takes all three of the code's choices. The defaults are the paper's gates and loss scale with the
code's zero router.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture

from moa.moa_attention import MixtureOfAttentionHeads
from moa.models.routed_transformer import (ATTENTION_TYPES, RoutedTransformerModel, add_compile_args, layer_top_k,
                                           parse_attention_types, parse_per_layer, routed_layer_config, routed_layer_counts,
                                           small_translation_shape)
from moa.routing import GATE_WEIGHTS, ROUTER_INITS

RELEASED_CODE = {"moa_gate_weights": "raw", "moa_router_init": "zeros", "moa_aux_loss_scale": "per-batch"}
DEFAULTS = {"moa_gate_weights": "renormalized", "moa_router_init": "zeros", "moa_aux_loss_scale": "per-token"}


def add_moa_args(parser):
    """The MoA command-line flags shared by every MoA model."""
    parser.add_argument("--moa-experts", type=int, metavar="E", help="attention experts per MoA module")
    parser.add_argument("--moa-top-k", type=int, metavar="K", help="experts selected per token")
    parser.add_argument("--moa-top-k-per-layer", type=str, metavar="LIST",
                        help="experts selected per token in each layer, comma-separated, one per layer (e.g. "
                             "2,2,4,4: fewer in shallow layers); replaces --moa-top-k in every MoA layer")
    parser.add_argument("--moa-head-dim", type=int, metavar="D", help="width of each expert head and of the shared K/V head")
    parser.add_argument("--moa-gate-weights", choices=GATE_WEIGHTS,
                        help="renormalized: p / detach(sum of the selected p), as in the paper (default); "
                             "raw: the softmax probabilities, as in the authors' released code")
    parser.add_argument("--moa-router-init", choices=ROUTER_INITS,
                        help="zeros: W_g = 0, every token starts with uniform routing, as in the authors' "
                             "released code (default; the paper names no initialisation); "
                             "normal: W_g ~ N(0, 1/d_model)")
    parser.add_argument("--moa-released-code", action="store_true",
                        help="all of the released code's choices where it departs from the paper: "
                             "--moa-gate-weights raw --moa-router-init zeros and the criterion's "
                             "--moa-aux-loss-scale per-batch (flags given explicitly win)")
    parser.add_argument("--moa-attention-types", type=str, metavar="LIST",
                        help="comma-separated attention types that use MoA, of " + ",".join(ATTENTION_TYPES)
                             + " (default: all); the others are fairseq multi-head attention")
    parser.add_argument("--moa-attention-bias", action="store_true",
                        help="give the MoA projections biases (the paper's parameter counts have none)")
    add_compile_args(parser)


def check_moa_args(args) -> None:
    """Refuse MoA flags that cannot build a model, naming the flag to change."""
    types = parse_attention_types(args.moa_attention_types, "--moa-attention-types")
    per_layer = parse_per_layer(getattr(args, "moa_top_k_per_layer", None), "--moa-top-k-per-layer",
                                routed_layer_counts(args, types))
    for flag, k in [("--moa-top-k", args.moa_top_k)] + [("--moa-top-k-per-layer", k) for k in per_layer or ()]:
        if not 1 <= k <= args.moa_experts:
            raise ValueError(f"{flag} {k} with --moa-experts {args.moa_experts}: "
                             "MoA selects between 1 and --moa-experts experts per token")
    if args.moa_head_dim < 1:
        raise ValueError(f"--moa-head-dim {args.moa_head_dim}: each expert's head needs a width of at least 1 "
                         "(the paper's D, e.g. 64 or 128)")


def moa_layer_config(args):
    """fairseq's layer config for ``args``, building MoA in the attention types that use it."""
    types = parse_attention_types(args.moa_attention_types, "--moa-attention-types")
    per_layer = parse_per_layer(getattr(args, "moa_top_k_per_layer", None), "--moa-top-k-per-layer",
                                routed_layer_counts(args, types))
    return routed_layer_config(args, types, build_moa_attention, per_layer)


def build_moa_attention(cfg, embed_dim, kind, kdim=None):
    return MixtureOfAttentionHeads(
        embed_dim,
        num_experts=cfg.moa_experts,
        top_k=layer_top_k(cfg, cfg.moa_top_k),
        head_dim=cfg.moa_head_dim,
        kdim=kdim,
        vdim=kdim,
        dropout=cfg.attention_dropout,
        bias=cfg.moa_attention_bias,
        self_attention=kind != "decoder-cross",
        encoder_decoder_attention=kind == "decoder-cross",
        gate_weights=cfg.moa_gate_weights,
        router_init=cfg.moa_router_init,
    )


@register_model("moa_transformer")
class MoATransformerModel(RoutedTransformerModel):
    """Transformer encoder-decoder whose attention modules are MoA (Zhang et al. 2022)."""

    layer_config = staticmethod(moa_layer_config)

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_moa_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_moa_args(args)  # fairseq has applied the arch function (the MoA defaults) already
        return super().build_model(args, task)



def set_moa_defaults(args, experts, top_k, head_dim):
    """Fill the MoA flags the user did not give; ``moa_aux_loss_scale`` is the criterion's flag, which
    ``--moa-released-code`` sets here (arch functions run before fairseq builds the criterion's config)."""
    args.moa_experts = getattr(args, "moa_experts", experts)
    args.moa_top_k = getattr(args, "moa_top_k", top_k)
    args.moa_head_dim = getattr(args, "moa_head_dim", head_dim)
    preset = RELEASED_CODE if getattr(args, "moa_released_code", False) else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.moa_attention_types = getattr(args, "moa_attention_types", ",".join(ATTENTION_TYPES))
    args.moa_attention_bias = getattr(args, "moa_attention_bias", False)
    args.moa_top_k_per_layer = getattr(args, "moa_top_k_per_layer", None)


@register_model_architecture("moa_transformer", "moa_transformer")
def moa_base_architecture(args):
    """fairseq's Transformer base shape with 8K8E128D MoA attention."""
    set_moa_defaults(args, experts=8, top_k=8, head_dim=128)
    base_architecture(args)


@register_model_architecture("moa_transformer", "moa_base")
def moa_base(args):
    """MoA Base: 8K8E128D, d_model 512, FFN 2048, 6+6 layers, the authors' dropouts."""
    args.dropout = getattr(args, "dropout", 0.2)
    args.attention_dropout = getattr(args, "attention_dropout", 0.2)
    args.activation_dropout = getattr(args, "activation_dropout", 0.1)
    moa_base_architecture(args)


@register_model_architecture("moa_transformer", "moa_big")
def moa_big(args):
    """MoA Big: 16K32E256D on the same 512/2048/6+6 shape and dropouts as MoA Base."""
    set_moa_defaults(args, experts=32, top_k=16, head_dim=256)
    moa_base(args)


@register_model_architecture("moa_transformer", "moa_small")
def moa_small(args):
    """A CPU-sized MoA: d_model 256, FFN 1024, 3+3 layers, 4K8E64D."""
    small_translation_shape(args)
    set_moa_defaults(args, experts=8, top_k=4, head_dim=64)
    base_architecture(args)
