"""``switchhead_transformer``: fairseq's Transformer with SwitchHead attention (Csordas et al. 2024).

The model subclasses fairseq's ``TransformerModel`` through the routed encoder and decoder of
:mod:`moa.models.routed_transformer`, building :class:`~moa.switchhead_attention.SwitchHeadAttention` in
the attention types ``--switchhead-attention-types`` names (default: all three).

A configuration is written ``{H}H{k}K{E}E{D}D``: H heads of width D, each choosing k of E value and k of
E output experts per token. Archs:

* ``switchhead_small``: ``moa_small``'s shape (d_model 256, FFN 1024, 3+3 layers), 2H2K4E56D: the cost of
  ``moa_small`` (MoA 4K8E64D) per target token; the parameter-matched point of the paper at this shape is
  ``--switchhead-heads 1 --switchhead-experts 7 --switchhead-head-dim 64`` (benchmarks/multi30k/README.md)
* ``switchhead_base``: transformer base's shape (d_model 512, FFN 2048, 6+6 layers), 2H2K3E128D: the
  parameters of its 8 heads of 64, 4 times fewer attention matrices

``--switchhead-heads``, ``--switchhead-experts``, ``--switchhead-top-k``, ``--switchhead-head-dim`` and
``--switchhead-expert-dropout`` override any arch. SwitchHead has no auxiliary loss: the plugin's
criteria add nothing for it and log its load's coefficient of variation (``switchhead_load_cv``).
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture

from moa.models.routed_transformer import (ATTENTION_TYPES, RoutedTransformerModel, add_compile_args,
                                           parse_attention_types, routed_layer_config, small_translation_shape)
from moa.switchhead_attention import SwitchHeadAttention


def add_switchhead_args(parser):
    """The SwitchHead command-line flags shared by every SwitchHead model."""
    parser.add_argument("--switchhead-heads", type=int, metavar="H", help="attention heads (attention matrices) "
                                                                         "per SwitchHead module")
    parser.add_argument("--switchhead-experts", type=int, metavar="E", help="value and output experts per head")
    parser.add_argument("--switchhead-top-k", type=int, metavar="K",
                        help="value and output experts selected per token in each head")
    parser.add_argument("--switchhead-head-dim", type=int, metavar="D", help="width of each head and expert")
    parser.add_argument("--switchhead-expert-dropout", type=float, metavar="P",
                        help="in training, leave each expert out of a token's top-k choice with probability P "
                             "(the released code's expert dropout; default 0)")
    parser.add_argument("--switchhead-attention-types", type=str, metavar="LIST",
                        help="comma-separated attention types that use SwitchHead, of " + ",".join(ATTENTION_TYPES)
                             + " (default: all); the others are fairseq multi-head attention")
    add_compile_args(parser)


def check_switchhead_args(args) -> None:
    """Refuse SwitchHead flags that cannot build a model, naming the flag to change."""
    parse_attention_types(args.switchhead_attention_types, "--switchhead-attention-types")
    for flag, value in (("--switchhead-heads", args.switchhead_heads), ("--switchhead-experts", args.switchhead_experts),
                        ("--switchhead-head-dim", args.switchhead_head_dim)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1")
    if not 1 <= args.switchhead_top_k <= args.switchhead_experts:
        raise ValueError(f"--switchhead-top-k {args.switchhead_top_k} with --switchhead-experts "
                         f"{args.switchhead_experts}: each head selects between 1 and --switchhead-experts experts")
    if not 0 <= args.switchhead_expert_dropout < 1:
        raise ValueError(f"--switchhead-expert-dropout {args.switchhead_expert_dropout}: give a probability in [0, 1)")


def switchhead_layer_config(args):
    """fairseq's layer config for ``args``, building SwitchHead in the attention types that use it."""
    types = parse_attention_types(args.switchhead_attention_types, "--switchhead-attention-types")
    return routed_layer_config(args, types, build_switchhead_attention)


def build_switchhead_attention(cfg, embed_dim, kind, kdim=None):
    return SwitchHeadAttention(
        embed_dim,
        num_heads=cfg.switchhead_heads,
        num_experts=cfg.switchhead_experts,
        top_k=cfg.switchhead_top_k,
        head_dim=cfg.switchhead_head_dim,
        kdim=kdim,
        vdim=kdim,
        dropout=cfg.attention_dropout,
        self_attention=kind != "decoder-cross",
        encoder_decoder_attention=kind == "decoder-cross",
        expert_dropout=cfg.switchhead_expert_dropout,
    )


@register_model("switchhead_transformer")
class SwitchHeadTransformerModel(RoutedTransformerModel):
    """Transformer encoder-decoder whose attention modules are SwitchHead (Csordas et al. 2024)."""

    layer_config = staticmethod(switchhead_layer_config)

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_switchhead_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_switchhead_args(args)
        return super().build_model(args, task)


def set_switchhead_defaults(args, heads, top_k, experts, head_dim):
    """Fill the SwitchHead flags the user did not give."""
    for name, value in (("switchhead_heads", heads), ("switchhead_top_k", top_k), ("switchhead_experts", experts),
                        ("switchhead_head_dim", head_dim), ("switchhead_expert_dropout", 0.0),
                        ("switchhead_attention_types", ",".join(ATTENTION_TYPES))):
        setattr(args, name, getattr(args, name, value))


@register_model_architecture("switchhead_transformer", "switchhead_transformer")
@register_model_architecture("switchhead_transformer", "switchhead_base")
def switchhead_base(args):
    """fairseq's Transformer base shape (512, FFN 2048, 6+6 layers) with 2H2K3E128D SwitchHead attention."""
    set_switchhead_defaults(args, heads=2, top_k=2, experts=3, head_dim=128)
    base_architecture(args)


@register_model_architecture("switchhead_transformer", "switchhead_small")
def switchhead_small(args):
    """A CPU-sized SwitchHead: d_model 256, FFN 1024, 3+3 layers, 2H2K4E56D."""
    small_translation_shape(args)
    set_switchhead_defaults(args, heads=2, top_k=2, experts=4, head_dim=56)
    base_architecture(args)
