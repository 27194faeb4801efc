"""``moa_transformer``: fairseq's Transformer with Mixture-of-Attention-heads layers.

The model subclasses fairseq's ``TransformerModel``; its encoder and decoder
layers subclass fairseq's layer classes and override only how attention is
built, so everything else (layer norm placement, dropout, layer drop,
activation checkpointing and FSDP wrapping) is fairseq's own.

Archs (all d_model 512, FFN 2048, 6+6 layers except ``moa_small``):

* ``moa_base``  8K8E128D with the authors' dropouts (0.2 / attention 0.2 / activation 0.1)
* ``moa_big``   16K32E256D, same shape and dropouts
* ``moa_small`` d_model 256, FFN 1024, 3+3 layers, 4K8E64D: for CPUs and tests

``--moa-experts``, ``--moa-top-k``, ``--moa-head-dim``, ``--moa-gate-weights``,
``--moa-attention-types`` and ``--moa-attention-bias`` override any arch.
"""

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
)
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from moa.attention import MixtureOfAttentionHeads
from moa.routing import GATE_WEIGHTS

ATTENTION_TYPES = ("encoder-self", "decoder-self", "decoder-cross")


def add_moa_args(parser):
    """The MoA command-line flags shared by every MoA model."""
    parser.add_argument("--moa-experts", type=int, metavar="E", help="attention experts per MoA module")
    parser.add_argument("--moa-top-k", type=int, metavar="K", help="experts selected per token")
    parser.add_argument("--moa-head-dim", type=int, metavar="D", help="width of each expert head and of the shared K/V head")
    parser.add_argument("--moa-gate-weights", choices=GATE_WEIGHTS,
                        help="renormalized: p / detach(sum of the selected p), as in the paper (default); "
                             "raw: the softmax probabilities, as in the authors' released code")
    parser.add_argument("--moa-attention-types", type=str, metavar="LIST",
                        help="comma-separated attention types that use MoA, of " + ",".join(ATTENTION_TYPES)
                             + " (default: all); the others are fairseq multi-head attention")
    parser.add_argument("--moa-attention-bias", action="store_true",
                        help="give the MoA projections biases (the paper's parameter counts have none)")


def parse_attention_types(value: str) -> frozenset:
    """``--moa-attention-types``: the validated set of attention types that use MoA."""
    names = frozenset(name.strip() for name in str(value).split(",") if name.strip())
    unknown = names - set(ATTENTION_TYPES)
    if unknown:
        raise ValueError(f"--moa-attention-types: unknown {sorted(unknown)}; choose from {','.join(ATTENTION_TYPES)}")
    return names


def check_moa_args(args) -> None:
    """Refuse MoA flags that cannot build a model, naming the flag to change."""
    parse_attention_types(args.moa_attention_types)
    if not 1 <= args.moa_top_k <= args.moa_experts:
        raise ValueError(f"--moa-top-k {args.moa_top_k} with --moa-experts {args.moa_experts}: "
                         "MoA selects between 1 and --moa-experts experts per token")


def moa_layer_config(args) -> TransformerConfig:
    """fairseq's layer config for ``args``, with ``moa_types``, the parsed attention types that use MoA."""
    cfg = TransformerConfig.from_namespace(args)
    cfg.moa_types = parse_attention_types(args.moa_attention_types)
    return cfg


def build_moa_attention(cfg, embed_dim, kdim=None, self_attention=False, encoder_decoder_attention=False):
    return MixtureOfAttentionHeads(
        embed_dim,
        num_experts=cfg.moa_experts,
        top_k=cfg.moa_top_k,
        head_dim=cfg.moa_head_dim,
        kdim=kdim,
        vdim=kdim,
        dropout=cfg.attention_dropout,
        bias=cfg.moa_attention_bias,
        self_attention=self_attention,
        encoder_decoder_attention=encoder_decoder_attention,
        gate_weights=cfg.moa_gate_weights,
    )


def wrap_layer(layer, cfg):
    """Apply fairseq's activation checkpointing and FSDP wrapping, as its own layer builders do."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class MoATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if "encoder-self" not in cfg.moa_types:
            return super().build_self_attention(embed_dim, cfg)
        return build_moa_attention(cfg, embed_dim, self_attention=True)


class MoATransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if "decoder-self" not in cfg.moa_types:
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("MoA decoder self-attention does not support --cross-self-attention, "
                             "add_bias_kv or add_zero_attn; leave decoder-self out of --moa-attention-types")
        return build_moa_attention(cfg, embed_dim, self_attention=True)

    def build_encoder_attention(self, embed_dim, cfg):
        if "decoder-cross" not in cfg.moa_types:
            return super().build_encoder_attention(embed_dim, cfg)
        return build_moa_attention(cfg, embed_dim, kdim=cfg.encoder.embed_dim, encoder_decoder_attention=True)


class MoATransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return wrap_layer(MoATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class MoATransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder, telling its MoA cross-attention modules which target positions are padding."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(MoATransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        cross = [m for m in self.modules() if isinstance(m, MixtureOfAttentionHeads) and m.encoder_decoder_attention]
        padding = prev_output_tokens.eq(self.padding_idx) if incremental_state is None and cross else None
        for module in cross:
            module.query_padding_mask = padding
        try:
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)
        finally:
            for module in cross:
                module.query_padding_mask = None


@register_model("moa_transformer")
class MoATransformerModel(TransformerModel):
    """Transformer encoder-decoder whose attention modules are MoA (Zhang et al. 2022)."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_moa_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_moa_args(args)  # fairseq has applied the arch function (the MoA defaults) already
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return MoATransformerEncoder(moa_layer_config(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return MoATransformerDecoder(moa_layer_config(args), tgt_dict, embed_tokens,
                                     no_encoder_attn=getattr(args, "no_cross_attention", False))


def set_moa_defaults(args, experts, top_k, head_dim):
    """Fill the MoA flags the user did not give."""
    args.moa_experts = getattr(args, "moa_experts", experts)
    args.moa_top_k = getattr(args, "moa_top_k", top_k)
    args.moa_head_dim = getattr(args, "moa_head_dim", head_dim)
    args.moa_gate_weights = getattr(args, "moa_gate_weights", "renormalized")
    args.moa_attention_types = getattr(args, "moa_attention_types", ",".join(ATTENTION_TYPES))
    args.moa_attention_bias = getattr(args, "moa_attention_bias", False)


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
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 256)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.encoder_layers = getattr(args, "encoder_layers", 3)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 3)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.dropout = getattr(args, "dropout", 0.1)
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    set_moa_defaults(args, experts=8, top_k=4, head_dim=64)
    base_architecture(args)
