"""``moa_roberta``: a RoBERTa-style masked-LM encoder whose self-attention is MoA.

It subclasses fairseq's ``RobertaModel``/``RobertaEncoder`` and swaps only the
sentence encoder for :class:`~moa.models.routed_transformer.RoutedTransformerEncoder`,
so fairseq's ``masked_lm`` task, LM head, classification heads and hub tools
apply unchanged. Train it with ``--task masked_lm --criterion moa_masked_lm``.

Archs (the paper's MLM range, k = 8 with E and D growing) on one documented
base shape: d_model 512, FFN 2048, 8 layers, GELU, learned positions, post-norm,
dropout 0.1 (``moa_roberta_8k8e128d`` ... ``moa_roberta_8k64e256d``), and
``moa_roberta_small`` (d_model 256, FFN 1024, 4 layers, 4K8E64D) for CPUs and tests.
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta.model import RobertaEncoder, RobertaModel
from fairseq.models.roberta.model import base_architecture as roberta_base_architecture
from fairseq.modules.transformer_sentence_encoder import init_bert_params
from torch import nn

from moa.moa_attention import MixtureOfAttentionHeads
from moa.models.moa_transformer import add_moa_args, check_moa_args, moa_layer_config, set_moa_defaults
from moa.models.routed_transformer import (RoutedModel, RoutedTransformerEncoder, add_activation_checkpointing_args,
                                           small_roberta_shape)


def init_moa_bert_params(module):
    """BERT's initialisation (normal, std 0.02) for the MoA parameters ``init_bert_params`` does not know."""
    if isinstance(module, MixtureOfAttentionHeads):
        for weight in (module.q_experts.weight, module.o_experts.weight):
            nn.init.normal_(weight, mean=0.0, std=0.02)
        module.router.reset_parameters(std=0.02)  # zeros under --moa-router-init zeros


class MoARobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = RoutedTransformerEncoder(moa_layer_config(args), dictionary, embed_tokens)
        encoder.apply(init_bert_params)
        encoder.apply(init_moa_bert_params)
        return encoder


@register_model("moa_roberta")
class MoARobertaModel(RoutedModel, RobertaModel):
    """RoBERTa whose encoder self-attention modules are MoA (Zhang et al. 2022, Sec. 4.2)."""

    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        add_activation_checkpointing_args(parser)
        add_moa_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_moa_args(args)  # fairseq has applied the arch function (the MoA defaults) already
        if not hasattr(args, "max_positions"):
            args.max_positions = getattr(args, "tokens_per_sample", None) or task.max_positions()
        return cls(args, MoARobertaEncoder(args, task.source_dictionary))


def moa_roberta_shape(args, experts, top_k, head_dim):
    """The MLM base shape: d_model 512, FFN 2048, 8 layers (RoBERTa's structure otherwise)."""
    args.encoder_layers = getattr(args, "encoder_layers", 8)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 2048)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    set_moa_defaults(args, experts=experts, top_k=top_k, head_dim=head_dim)
    roberta_base_architecture(args)


def _register(name, experts, top_k, head_dim, doc):
    def arch(args):
        moa_roberta_shape(args, experts, top_k, head_dim)

    arch.__doc__ = doc
    arch.__name__ = name
    return register_model_architecture("moa_roberta", name)(arch)


_register("moa_roberta", 8, 8, 128, "The default: 8K8E128D on the MLM base shape.")
for _e, _d in ((8, 128), (8, 256), (16, 256), (32, 256), (64, 256)):
    _register(f"moa_roberta_8k{_e}e{_d}d", _e, 8, _d, f"8K{_e}E{_d}D on the MLM base shape.")


@register_model_architecture("moa_roberta", "moa_roberta_small")
def moa_roberta_small(args):
    """A CPU-sized MoA masked LM: d_model 256, FFN 1024, 4 layers, 4K8E64D."""
    small_roberta_shape(args)
    set_moa_defaults(args, experts=8, top_k=4, head_dim=64)
    roberta_base_architecture(args)
