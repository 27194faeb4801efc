"""fairseq's Transformer with routed attention (MoA or MoH) in the attention types a flag names.

The encoder and decoder layers subclass fairseq's layer classes and override only how attention is
built, so everything else (layer norm placement, dropout, layer drop, FSDP wrapping) is fairseq's
own; activation checkpointing is :mod:`moa.activation_checkpointing`'s, which keeps the auxiliary
losses' gradient. Which module a routed attention type gets is the model's choice:
:func:`routed_layer_config` puts the parsed attention types and a builder on fairseq's layer config.

:class:`RoutedModel` is how a model hands its routing decisions (and so its auxiliary losses) to the
criterion: :func:`pop_named_routings`.
"""

import logging
import re
from typing import Callable, Dict, List, Optional, Tuple

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerConfig, TransformerDecoderBase, TransformerEncoderBase, TransformerModel
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import nn

from moa.activation_checkpointing import checkpoint_routed_layer
from moa.fairseq_fixes.checkpoint_safety import last_loaded_checkpoint
from moa.fairseq_fixes.named_errors import NamedInputError
from moa.routed_attention import RoutedAttention, compile_routed_attention
from moa.routing import Routing

logger = logging.getLogger(__name__)

ATTENTION_TYPES = ("encoder-self", "decoder-self", "decoder-cross")


def parse_attention_types(value: str, flag: str) -> frozenset:
    """The validated set of attention types named by ``flag`` (comma-separated)."""
    names = frozenset(name.strip() for name in str(value).split(",") if name.strip())
    unknown = names - set(ATTENTION_TYPES)
    if unknown:
        raise ValueError(f"{flag}: unknown {sorted(unknown)}; choose from {','.join(ATTENTION_TYPES)}")
    return names


def attention_site(module_name: str) -> Tuple[str, int]:
    """(attention type, layer index) of an attention module by its name in a fairseq model:
    ``encoder.layers.2.self_attn`` -> ("encoder-self", 2), ``decoder.layers.0.encoder_attn`` ->
    ("decoder-cross", 0); RoBERTa's ``encoder.sentence_encoder.layers.N.self_attn`` is encoder-self."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.(self_attn|encoder_attn)$", module_name)
    if not match:
        raise ValueError(f"{module_name!r} is not the attention module of a fairseq Transformer layer")
    side = "decoder" if module_name.startswith("decoder.") else "encoder"
    kind = "cross" if match.group(2) == "encoder_attn" else "self"
    return f"{side}-{kind}", int(match.group(1))


def routed_layer_config(args, types: frozenset, build_attention: Callable,
                        top_k_per_layer: Optional[List[int]] = None) -> TransformerConfig:
    """fairseq's layer config for ``args`` with ``routed_types`` and ``build_routed_attention(cfg,
    embed_dim, kind, kdim=None)``, ``kind`` one of :data:`ATTENTION_TYPES`; ``top_k_per_layer``:
    the experts or heads each layer routes to (:func:`layer_top_k`), or None for the same everywhere.
    While a stack builds its layers, ``cfg.routed_layer`` is the index of the layer being built."""
    cfg = TransformerConfig.from_namespace(args)
    cfg.routed_types = types
    cfg.build_routed_attention = build_attention
    if getattr(args, "compile_routed_attention", False):
        def build_attention_compiled(*a, **kw):
            module = build_attention(*a, **kw)
            compile_routed_attention(module)
            return module
        cfg.build_routed_attention = build_attention_compiled
    cfg.top_k_per_layer = top_k_per_layer
    cfg.routed_layer = 0
    return cfg


def parse_per_layer(value, flag: str, layers: Dict[str, int]) -> Optional[List[int]]:
    """The integers of a per-layer flag (comma-separated, one per layer), or None when it is not given.
    ``layers``: the layer count of each attention type that routes; every one must match."""
    if value is None or str(value).strip() == "":
        return None
    try:
        values = [int(v) for v in str(value).split(",")]
    except ValueError:
        raise ValueError(f"{flag} {value!r}: give one integer per layer, comma-separated (e.g. 1,1,2,2)") from None
    for kind, count in sorted(layers.items()):
        if len(values) != count:
            raise ValueError(f"{flag} {value}: {len(values)} values, but {kind} attention has {count} layers; "
                             f"give one value per layer")
    return values


def routed_layer_counts(args, types) -> Dict[str, int]:
    """The layer count of each routed attention type the model has: the encoder's for encoder-self,
    the decoder's for the decoder's types (a masked LM has no decoder, a language model no encoder)."""
    counts = {}
    for kind in types:
        layers = getattr(args, "encoder_layers" if kind == "encoder-self" else "decoder_layers", None)
        if layers is not None:
            counts[kind] = layers
    return counts


def layer_top_k(cfg, default: int) -> int:
    """The top-k of the layer being built: its entry of ``cfg.top_k_per_layer``, else ``default``."""
    per_layer = getattr(cfg, "top_k_per_layer", None)
    return default if per_layer is None else per_layer[cfg.routed_layer]


def next_layer(stack, cfg) -> None:
    """Set ``cfg.routed_layer`` to the index of the next layer ``stack`` builds (fairseq builds them
    in order, before the stack's layer list holds any)."""
    cfg.routed_layer = getattr(stack, "_routed_layers_built", 0)
    stack._routed_layers_built = cfg.routed_layer + 1


def wrap_layer(layer, cfg):
    """Apply activation checkpointing and fairseq's FSDP wrapping, as fairseq's own layer builders
    do; the checkpointing is :func:`~moa.activation_checkpointing.checkpoint_routed_layer`, which
    keeps the auxiliary losses' gradient."""
    checkpoint = cfg.checkpoint_activations or cfg.offload_activations  # offloading implies checkpointing
    if checkpoint:
        layer = checkpoint_routed_layer(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


def add_compile_args(parser) -> None:
    """The flag that runs the routed attention modules through torch.compile (training and decoding)."""
    parser.add_argument("--compile-routed-attention", action="store_true",
                        help="run every routed attention module's computation through torch.compile (inductor, "
                             "dynamic shapes); fairseq-generate takes it as --model-overrides "
                             "\"{'compile_routed_attention': True}\"")


def add_activation_checkpointing_args(parser) -> None:
    """fairseq's Transformer flags for activation checkpointing, which its RoBERTa lacks."""
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="checkpoint activations at each layer, which saves GPU memory at the cost of "
                             "recomputing the layers in the backward pass")
    parser.add_argument("--offload-activations", action="store_true",
                        help="checkpoint activations and keep the saved ones in CPU memory (implies "
                             "--checkpoint-activations)")


class RoutedTransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if "encoder-self" not in cfg.routed_types:
            return super().build_self_attention(embed_dim, cfg)
        return cfg.build_routed_attention(cfg, embed_dim, "encoder-self")


class RoutedTransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if "decoder-self" not in cfg.routed_types:
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("routed decoder self-attention does not support --cross-self-attention, "
                             "add_bias_kv or add_zero_attn; leave decoder-self out of the attention types")
        return cfg.build_routed_attention(cfg, embed_dim, "decoder-self")

    def build_encoder_attention(self, embed_dim, cfg):
        if "decoder-cross" not in cfg.routed_types:
            return super().build_encoder_attention(embed_dim, cfg)
        return cfg.build_routed_attention(cfg, embed_dim, "decoder-cross", kdim=cfg.encoder.embed_dim)


class RoutedTransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        next_layer(self, cfg)
        return wrap_layer(RoutedTransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class RoutedTransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder, telling its routed cross-attention modules which target positions are padding."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        next_layer(self, cfg)
        return wrap_layer(RoutedTransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        if incremental_state is not None:  # a decoding step: no query padding to pass, no module walk
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)
        cross = [m for m in self.modules() if isinstance(m, RoutedAttention) and m.encoder_decoder_attention]
        padding = prev_output_tokens.eq(self.padding_idx) if cross else None
        for module in cross:
            module.query_padding_mask = padding
        try:
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)
        finally:
            for module in cross:
                module.query_padding_mask = None


def small_translation_shape(args) -> None:
    """The CPU shape of ``moa_small`` and ``moh_small``: d_model 256, FFN 1024, 3+3 layers, 4 heads,
    dropout 0.1 and attention dropout 0.1 (flags the user gave win)."""
    for name, value in (("encoder_embed_dim", 256), ("encoder_ffn_embed_dim", 1024), ("encoder_layers", 3),
                        ("encoder_attention_heads", 4), ("decoder_layers", 3), ("decoder_attention_heads", 4),
                        ("dropout", 0.1), ("attention_dropout", 0.1)):
        setattr(args, name, getattr(args, name, value))


def small_roberta_shape(args) -> None:
    """The CPU shape of ``moa_roberta_small`` and ``moh_roberta_small``: d_model 256, FFN 1024, 4 layers, 4 heads."""
    for name, value in (("encoder_layers", 4), ("encoder_embed_dim", 256), ("encoder_ffn_embed_dim", 1024),
                        ("encoder_attention_heads", 4)):
        setattr(args, name, getattr(args, name, value))


class RoutedModel:
    """Mixed into the MoA and MoH models: the routing decisions of the last forward, for the criterion,
    and a clear error for a checkpoint trained on other dictionaries."""

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        files = {side: getattr(getattr(getattr(self, side, None), "dictionary", None), "loaded_from", None)
                 for side in ("encoder", "decoder")}
        check_dictionary_sizes(self.state_dict(), state_dict, files)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def set_beam_size(self, beam_size: int) -> None:
        """Called by fairseq's SequenceGenerator before beam search: the routed encoder-decoder
        attention modules keep one copy of the source keys and values per sentence in incremental
        decoding (:meth:`~moa.routed_attention.RoutedAttention.set_beam_size`). fairseq's own
        ``MultiheadAttention`` is left alone: it would apply the beam to training batches too."""
        for module in self.modules():
            if isinstance(module, RoutedAttention) and module.encoder_decoder_attention:
                module.set_beam_size(beam_size)

    def active_share(self) -> Dict[str, Tuple[int, int]]:
        """family ("MoA", "MoH") -> (active, total) summed over its routed modules: the experts each
        token uses of all experts (MoA), or the heads active per token of all heads (MoH)."""
        shares: Dict[str, Tuple[int, int]] = {}
        for module in self.modules():
            if isinstance(module, RoutedAttention):
                family, active, total = module.active_heads()
                a, t = shares.get(family, (0, 0))
                shares[family] = (a + active, t + total)
        return shares

    def describe_active_share(self) -> str:
        """One line for the model summary, e.g. ``MoH: 12 of 16 heads active per token (75.0%)``."""
        unit = {"MoA": "experts", "MoH": "heads", "SwitchHead": "value and output experts"}
        return "; ".join(f"{family}: {a} of {t} {unit.get(family, 'heads')} active per token ({a / t:.1%})"
                         for family, (a, t) in sorted(self.active_share().items()))

    def pop_routings(self) -> List[Routing]:
        """The :class:`~moa.routing.Routing` of every routed module since the last call, clearing them."""
        return [routing for _, routing in pop_named_routings(self)]

    def pop_named_routings(self) -> List[Tuple[str, Routing]]:
        """(module name, routing) of every routed module since the last call, clearing them."""
        return pop_named_routings(self)


def pop_named_routings(model: nn.Module) -> List[Tuple[str, Routing]]:
    """(module name, :class:`~moa.routing.Routing`) of every routed attention module of ``model`` since
    the last call, clearing them; empty for a model without routed attention."""
    routings = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedAttention) and module.routing is not None:
            routings.append((name, module.routing))
            module.routing = None
    return routings


class ForeignDictionaryError(NamedInputError, ValueError):
    """A dictionary that is not the one the model or data needs."""


def check_dictionary_sizes(model_state, checkpoint_state, files=None) -> None:
    """Refuse a checkpoint whose embedding tables do not match this model's dictionaries, naming both sizes
    (and the dictionary file, from ``files``: {"encoder" or "decoder": path or None})."""
    for name, ours in model_state.items():
        if name.endswith("embed_tokens.weight") and name in checkpoint_state:
            theirs = checkpoint_state[name].shape[0]
            if theirs != ours.shape[0]:
                side = "target" if name.startswith("decoder.") else "source"
                checkpoint = last_loaded_checkpoint()
                file = (files or {}).get("decoder" if side == "target" else "encoder")
                raise ForeignDictionaryError(
                    f"the checkpoint's {side} dictionary has {theirs} symbols"
                    f"{f' ({checkpoint})' if checkpoint else ''}, this data's{f' ({file})' if file else ''} has "
                    f"{ours.shape[0]} ({name}): it was trained on another data-bin, or the dictionary changed. "
                    f"Use the data-bin it was trained with (the same dict.*.txt), or train a new model on this one")


class RoutedTransformerModel(RoutedModel, TransformerModel):
    """fairseq's ``TransformerModel`` with the routed encoder and decoder; a subclass says which
    attention they build through ``layer_config(args)`` (a :func:`routed_layer_config`)."""

    layer_config: Callable = None

    @classmethod
    def build_model(cls, args, task):
        """fairseq's, then one line of what the routed attention computes per token (any
        ``--model-overrides`` of k applied), e.g. ``MoA: 12 of 36 experts active per token (33.3%)``."""
        if getattr(args, "share_all_embeddings", False) and task.source_dictionary != task.target_dictionary:
            files = [getattr(d, "loaded_from", "a dictionary") for d in (task.source_dictionary, task.target_dictionary)]
            raise ForeignDictionaryError(
                f"--share-all-embeddings needs one joined dictionary, but {files[0]} ({len(task.source_dictionary)} "
                f"symbols) and {files[1]} ({len(task.target_dictionary)}) differ: prepare the data again with "
                f"fairseq-preprocess --joined-dictionary (or one of them is damaged), or train without "
                f"--share-all-embeddings")
        model = super().build_model(args, task)
        logger.info(model.describe_active_share())
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return RoutedTransformerEncoder(cls.layer_config(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return RoutedTransformerDecoder(cls.layer_config(args), tgt_dict, embed_tokens,
                                        no_encoder_attn=getattr(args, "no_cross_attention", False))
