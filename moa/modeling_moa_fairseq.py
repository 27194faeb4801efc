"""Models trained with the moa fairseq plugin, in Hugging Face ``transformers`` (``moa-export-hf``).

Imports torch, transformers and the plugin's torch-only attention layers beside it (relative imports, so
the files travel with an exported model and load with ``trust_remote_code=True``: no fairseq, no moa).
The networks are fairseq's, module for module and with fairseq's parameter names, so a fairseq state dict
loads as it is and the outputs are fairseq's:

* :class:`MoaFairseqForCausalLM`: fairseq's ``transformer_lm`` decoder; ``generate`` is transformers' own,
  with the decoder's key/value cache (fairseq's incremental state) as its cache.
* :class:`MoaFairseqForConditionalGeneration`: fairseq's ``transformer`` encoder-decoder; ``generate`` is
  fairseq-generate's beam search (:mod:`fairseq_beam_search`) on the same cache.
* :class:`MoaFairseqForMaskedLM`: fairseq's RoBERTa encoder and LM head.

Each stack: token embeddings scaled by sqrt(d) (unless fairseq's ``--no-scale-embedding``), sinusoidal or
learned positions from fairseq's position numbering, post- or pre-norm layers with MoA, MoH, SwitchHead or
fairseq's multi-head attention in each attention module as trained. A forward with ``labels`` returns the
mean cross-entropy plus the routers' auxiliary losses as the plugin's criteria weigh them (MoA: alpha L_a +
beta L_z per module; MoH: beta times the mean L_b; SwitchHead: none), so ``transformers.Trainer`` fine-tunes
with the training objective; ``routing`` in the output holds each routed module's decision.
"""

import copy
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_moa_fairseq import MoaFairseqConfig
from .fairseq_beam_search import beam_search
from .incremental_state import IncrementalStateModule
from .moa_attention import MixtureOfAttentionHeads
from .moh_attention import MixtureOfHeadsAttention
from .routed_attention import RoutedAttention
from .switchhead_attention import SwitchHeadAttention

ATTENTION = {"moa": MixtureOfAttentionHeads, "moh": MixtureOfHeadsAttention, "switchhead": SwitchHeadAttention}
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_accurate": lambda x: F.gelu(x, approximate="tanh"), "tanh": torch.tanh}


class MultiheadAttention(IncrementalStateModule):
    """fairseq's ``MultiheadAttention`` (its parameter names; q scaled by D^-1/2 after its projection) as
    self-attention or encoder-decoder attention, with fairseq's key/value cache in incremental decoding."""

    def __init__(self, embed_dim: int, num_heads: int, kdim: Optional[int] = None, dropout: float = 0.0, **unused):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = num_heads, embed_dim // num_heads, dropout
        kdim = kdim or embed_dim
        self.q_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.k_proj, self.v_proj = nn.Linear(kdim, embed_dim), nn.Linear(kdim, embed_dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                incremental_state=None, static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                **unused) -> Tuple[Tensor, None]:
        """query (T, B, C), key/value (S, B, kdim) -> (T, B, C); key padding True at padding; attn_mask
        additive (T, S). In incremental decoding the keys and values are cached (encoder-decoder attention:
        computed once, ``static_kv``)."""
        tgt_len, bsz, dim = query.shape

        def heads(t):  # (L, B, C) -> (B, H, L, D)
            return t.reshape(t.size(0), bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        cache = {} if incremental_state is None else (self.get_incremental_state(incremental_state, "attn_state") or {})
        if static_kv and "prev_key" in cache:
            k, v = cache["prev_key"], cache["prev_value"]
        else:
            k, v = heads(self.k_proj(key)), heads(self.v_proj(value))
            if "prev_key" in cache:
                k, v = torch.cat([cache["prev_key"], k], 2), torch.cat([cache["prev_value"], v], 2)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "attn_state", {"prev_key": k, "prev_value": v})
        scores = torch.matmul(heads(self.q_proj(query) * self.head_dim ** -0.5), k.transpose(2, 3))
        if attn_mask is not None:
            scores = scores + attn_mask
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(F.dropout(probs, self.dropout, self.training), v)
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, dim)), None

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        cache = self.get_incremental_state(incremental_state, "attn_state")
        if cache:
            self.set_incremental_state(incremental_state, "attn_state",
                                       {name: t.index_select(0, new_order) for name, t in cache.items()})


def sinusoidal_positions(num_embeddings: int, dim: int, padding_idx: int) -> Tensor:
    """fairseq's sinusoidal table (tensor2tensor's): sin and cos halves, row ``padding_idx`` zero."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(num_embeddings, -1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_embeddings, 1)], dim=1)
    table[padding_idx] = 0
    return table


def positions_of(tokens: Tensor, padding_idx: int) -> Tensor:
    """fairseq's position numbers: padding_idx + 1, + 2, ... over the non-padding tokens, padding_idx at padding."""
    mask = tokens.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1) * mask).long() + padding_idx


def attention_module(config: MoaFairseqConfig, stack: dict, kind: str, layer: int, kdim: Optional[int] = None):
    """The attention module of ``stack``'s layer ``layer`` (``kind``: "self" or "cross"): the routed module of
    ``config.family`` with its recorded arguments, or fairseq's dense attention where none are recorded."""
    recorded = stack[f"{kind}_attention"]
    arguments = recorded[layer] if recorded else None
    common = dict(kdim=kdim, dropout=config.attention_dropout, self_attention=kind == "self",
                  encoder_decoder_attention=kind == "cross")
    if arguments is None:
        return MultiheadAttention(stack["embed_dim"], stack["attention_heads"], **common)
    return ATTENTION[config.family](stack["embed_dim"], **arguments, **common)


class TransformerLayer(nn.Module):
    """fairseq's ``TransformerEncoderLayerBase`` or ``TransformerDecoderLayerBase``: self-attention, (decoder)
    encoder attention and FFN blocks, each with dropout, a residual and a layer norm before
    (``normalize_before``) or after."""

    def __init__(self, config: MoaFairseqConfig, stack: dict, layer: int, encoder_dim: Optional[int] = None):
        super().__init__()
        d = stack["embed_dim"]
        self.self_attn = attention_module(config, stack, "self", layer)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        if encoder_dim is not None:
            self.encoder_attn = attention_module(config, stack, "cross", layer, kdim=encoder_dim)
            self.encoder_attn_layer_norm = nn.LayerNorm(d)
        else:
            self.encoder_attn = None
        self.fc1, self.fc2 = nn.Linear(d, stack["ffn_dim"]), nn.Linear(stack["ffn_dim"], d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.activation = ACTIVATIONS[config.activation_fn]
        self.config, self.normalize_before = config, stack["normalize_before"]

    def block(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        residual = x
        x = sublayer(norm(x) if self.normalize_before else x)
        x = residual + F.dropout(x, self.config.dropout, self.training)
        return x if self.normalize_before else norm(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.dropout(self.activation(self.fc1(x)), self.config.activation_dropout, self.training))

    def forward(self, x: Tensor, padding: Optional[Tensor], future: Optional[Tensor], encoder_out: Optional[Tensor] = None,
                encoder_padding: Optional[Tensor] = None, incremental_state=None, last: bool = False) -> Tensor:
        """x: (T, B, C); ``last``: the decoder's last layer, whose encoder attention fairseq asks for per-head weights."""
        x = self.block(x, self.self_attn_layer_norm, lambda h: self.self_attn(
            h, h, h, key_padding_mask=padding, incremental_state=incremental_state, need_weights=False,
            attn_mask=future)[0])
        if encoder_out is not None:  # fairseq asks for the weights in inference, which picks the attention's path
            x = self.block(x, self.encoder_attn_layer_norm, lambda h: self.encoder_attn(
                h, encoder_out, encoder_out, key_padding_mask=encoder_padding, incremental_state=incremental_state,
                static_kv=True, need_weights=last or not self.training, need_head_weights=last)[0])
        return self.block(x, self.final_layer_norm, self.feed_forward)


class Stack(nn.Module):
    """fairseq's ``TransformerEncoderBase`` or ``TransformerDecoderBase`` (``cross``: with encoder attention)."""

    def __init__(self, config: MoaFairseqConfig, stack: dict, encoder_dim: Optional[int] = None):
        super().__init__()
        d, pad = stack["embed_dim"], config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=pad)
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.embed_positions = None
        if config.token_positions and stack["learned_positions"]:
            self.embed_positions = nn.Embedding(stack["max_positions"] + pad + 1, d, padding_idx=pad)
        self.sinusoidal: Optional[Tensor] = None  # fairseq's table, made on first use (not a buffer: nothing to load)
        self.layernorm_embedding = nn.LayerNorm(d) if config.layernorm_embedding else None
        self.layers = nn.ModuleList(TransformerLayer(config, stack, i, encoder_dim) for i in range(stack["layers"]))
        self.layer_norm = nn.LayerNorm(d) if stack["final_layer_norm"] else None
        self.config, self.stack = config, stack

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions (B, T) -> (T, B, C): scaled token embeddings, positions, layer norm, dropout."""
        c = self.config
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        elif c.token_positions:
            rows = max(int(positions.max()) + 1, self.stack["max_positions"] + c.pad_token_id + 1)
            if self.sinusoidal is None or self.sinusoidal.size(0) < rows or self.sinusoidal.device != x.device:
                self.sinusoidal = sinusoidal_positions(rows, self.stack["embed_dim"], c.pad_token_id).to(x.device)
            x = x + self.sinusoidal.to(x.dtype)[positions]
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, c.dropout, self.training).transpose(0, 1)

    def finish(self, x: Tensor) -> Tensor:
        return x if self.layer_norm is None else self.layer_norm(x)


class Encoder(Stack):
    def forward(self, tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """tokens (B, S) -> (encoder output (S, B, C), padding (B, S) True at padding)."""
        padding = tokens.eq(self.config.pad_token_id)
        x = self.embed(tokens, positions_of(tokens, self.config.pad_token_id))
        if padding.any():  # fairseq zeroes the padding positions' embeddings
            x = x * (1 - padding.T.unsqueeze(-1).type_as(x))
        for layer in self.layers:
            x = layer(x, padding if padding.any() else None, None)
        return self.finish(x), padding


class Decoder(Stack):
    def __init__(self, config: MoaFairseqConfig, stack: dict, encoder_dim: Optional[int] = None):
        super().__init__(config, stack, encoder_dim)
        self.output_projection = nn.Linear(stack["embed_dim"], config.vocab_size, bias=False)

    def forward(self, tokens: Tensor, encoder_out: Optional[Tensor] = None, encoder_padding: Optional[Tensor] = None,
                incremental_state=None) -> Tensor:
        """tokens (B, T) -> logits (B, T, V); in incremental decoding (``incremental_state``, a dict this call
        updates) only the last token is new: logits (B, 1, V)."""
        positions = positions_of(tokens, self.config.pad_token_id)
        if incremental_state is not None:
            tokens, positions = tokens[:, -1:], positions[:, -1:]
        x = self.embed(tokens, positions)
        padding = tokens.eq(self.config.pad_token_id)
        padding = padding if padding.any() else None
        future = None
        if incremental_state is None:
            future = torch.triu(torch.full((x.size(0), x.size(0)), float("-inf"), device=x.device, dtype=x.dtype), 1)
        cross = [layer.encoder_attn for layer in self.layers if encoder_out is not None and
                 isinstance(layer.encoder_attn, RoutedAttention) and incremental_state is None]
        for module in cross:  # the target's padding, which routed cross-attention keeps out of its statistics
            module.query_padding_mask = tokens.eq(self.config.pad_token_id)
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x, padding, future, encoder_out, encoder_padding, incremental_state,
                          last=i == len(self.layers) - 1)
        finally:
            for module in cross:
                module.query_padding_mask = None
        return self.output_projection(self.finish(x).transpose(0, 1))

    def reorder_incremental_state(self, incremental_state, new_order: Tensor) -> None:
        """Reorder every attention module's cache along the batch (beam search)."""
        for module in self.modules():
            if isinstance(module, IncrementalStateModule):
                module.reorder_incremental_state(incremental_state, new_order)


@dataclass
class MoaModelOutput(ModelOutput):
    """``loss`` (the training objective: task loss plus auxiliary terms), ``logits`` (B, T, V), ``lm_loss``
    (the cross-entropy alone, nats per token), ``aux_loss``, ``routing`` (each routed module's decision) and
    ``cache`` (the decoder's key/value cache, in generation)."""

    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    lm_loss: Optional[Tensor] = None
    aux_loss: Optional[Tensor] = None
    routing: Optional[List] = None
    cache: Optional[Dict] = None


class MoaFairseqPreTrainedModel(PreTrainedModel):
    config_class = MoaFairseqConfig
    _no_split_modules = ["TransformerLayer"]

    def _init_weights(self, module):  # weights come from the fairseq checkpoint; fresh models use torch's defaults
        pass

    def output(self, logits: Tensor, labels: Optional[Tensor], shift: bool, cache=None) -> MoaModelOutput:
        """The output of a forward that left its routing decisions in the routed modules: with ``labels``
        (-100 or padding ignored; ``shift``: position t predicts label t + 1), cross-entropy plus aux terms."""
        routing = [m.routing for m in self.modules() if isinstance(m, RoutedAttention) and m.routing is not None]
        loss = lm_loss = aux = None
        if labels is not None:
            logits_, labels = (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)
            target = labels.masked_fill(labels.eq(self.config.pad_token_id), -100)
            lm_loss = F.cross_entropy(logits_.float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)
            aux = routing_aux_loss(routing, self.config.aux_weights, logits.new_zeros((), dtype=torch.float32))
            loss = lm_loss + aux
        return MoaModelOutput(loss=loss, logits=logits, lm_loss=lm_loss, aux_loss=aux, routing=routing, cache=cache)

    def clear_routing(self) -> None:
        for module in self.modules():
            if isinstance(module, RoutedAttention):
                module.routing = None


class MoaFairseqForCausalLM(MoaFairseqPreTrainedModel, GenerationMixin):
    """A fairseq ``transformer_lm``-style language model (MoA, MoH, SwitchHead or dense self-attention)."""

    _tied_weights_keys = {"decoder.output_projection.weight": "decoder.embed_tokens.weight"}

    def __init__(self, config: MoaFairseqConfig):
        super().__init__(config)
        self.decoder = Decoder(config, config.decoder_stack)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embed_tokens

    def set_input_embeddings(self, value):
        self.decoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.decoder.output_projection

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                cache: Optional[Dict] = None, **kwargs) -> MoaModelOutput:
        """input_ids: (B, T) fairseq dictionary ids (padding: ``pad_token_id``, as fairseq pads; a given
        ``attention_mask`` marks padding with 0 and is applied as fairseq's padding). ``labels``: (B, T),
        the next token of each position is predicted (shifted here, as transformers' causal LMs do);
        -100 or padding is ignored. ``cache``: the key/value cache of incremental decoding (a dict; its
        ``"length"`` the tokens it holds): only the tokens after those are run, one at a time."""
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask.eq(0), self.config.pad_token_id)
        self.clear_routing()
        if cache is None:
            return self.output(self.decoder(input_ids), labels, shift=True)
        start, steps = cache.get("length", 0), []
        for end in range(start + 1, input_ids.size(1) + 1):
            steps.append(self.decoder(input_ids[:, :end], incremental_state=cache))
        cache["length"] = input_ids.size(1)
        return self.output(torch.cat(steps, dim=1), labels, shift=True, cache=cache)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # the cache is fairseq's incremental state, made below
        return False

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, use_cache=True, **kwargs):
        """The key/value cache, unless padding in the prompt (then every step runs the whole prefix)."""
        if not use_cache or (attention_mask is not None and not bool(attention_mask.all())):
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        return {"input_ids": input_ids, "cache": {} if cache is None else cache}

    def _reorder_cache(self, cache: Dict, beam_idx: Tensor) -> Dict:
        self.decoder.reorder_incremental_state(cache, beam_idx)
        return cache


class MoaFairseqForConditionalGeneration(MoaFairseqPreTrainedModel, GenerationMixin):
    """fairseq's ``transformer`` encoder-decoder (MoA, MoH, SwitchHead or dense attention where it was trained
    with each); ``generate`` is fairseq-generate's beam search."""

    def __init__(self, config: MoaFairseqConfig):
        super().__init__(config)
        self.encoder = Encoder(config, config.encoder_stack)
        self.decoder = Decoder(config, config.decoder_stack, encoder_dim=config.encoder_stack["embed_dim"])
        self._tied_weights_keys = {"decoder.output_projection.weight": "decoder.embed_tokens.weight"}
        if config.share_all_embeddings:
            self._tied_weights_keys["encoder.embed_tokens.weight"] = "decoder.embed_tokens.weight"
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def get_output_embeddings(self):
        return self.decoder.output_projection

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, **kwargs) -> MoaModelOutput:
        """input_ids (B, S): source ids; ``labels`` (B, T): the target, ending in EOS (what fairseq's
        ``target`` holds); ``decoder_input_ids``: fairseq's ``prev_output_tokens`` (EOS then the target
        without its EOS), made from ``labels`` when not given. Logits (B, T, V) teacher-forced, as fairseq's."""
        pad = self.config.pad_token_id
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask.eq(0), pad)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("give labels (the target) or decoder_input_ids; to translate, call generate()")
            target = labels.masked_fill(labels.eq(-100), pad)
            decoder_input_ids = torch.cat([target.new_full((target.size(0), 1), self.config.decoder_start_token_id),
                                           target[:, :-1]], dim=1)
            decoder_input_ids = decoder_input_ids.masked_fill(decoder_input_ids.eq(self.config.eos_token_id) &
                                                              target.eq(pad), pad)
        self.clear_routing()
        encoder_out, padding = self.encoder(input_ids)
        return self.output(self.decoder(decoder_input_ids, encoder_out, padding), labels, shift=False)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, generation_config=None,
                 **kwargs) -> Tensor:
        """fairseq-generate's beam search on the decoder's key/value cache. input_ids (B, S) source ids (padding
        ``pad_token_id``, or where ``attention_mask`` is 0). Settings from ``generation_config`` (the exported
        one: fairseq-generate's ``--beam 4 --lenpen 0.6``, ``max_len_a``/``max_len_b``), overridden by
        ``num_beams``, ``length_penalty``, ``max_len_a``, ``max_len_b``, ``min_length``,
        ``num_return_sequences`` given here. Returns (B * num_return_sequences, L): the decoder start (EOS),
        each hypothesis (best first) and its EOS, then padding."""
        settings = copy.deepcopy(generation_config or self.generation_config)
        for name, value in kwargs.items():
            if not isinstance(value, Tensor):  # a tokenizer's other outputs (token_type_ids) are not settings
                setattr(settings, name, value)
        c, pad, eos = self.config, self.config.pad_token_id, self.config.eos_token_id
        beam = min(settings.num_beams or 1, c.vocab_size - 1)
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask.eq(0), pad)
        encoder_out, padding = self.encoder(input_ids)
        bsz, src_len = input_ids.shape
        max_len = min(int(getattr(settings, "max_len_a", 0) * src_len + getattr(settings, "max_len_b", 200)),
                      c.decoder_stack["max_positions"] - 1)
        order = torch.arange(bsz, device=input_ids.device).repeat_interleave(beam)
        state = {"encoder_out": encoder_out.index_select(1, order), "padding": padding.index_select(0, order)}
        cache: Dict = {}
        self.set_beam_size(beam)

        def next_log_probs(tokens: Tensor, reorder: Optional[Tensor]) -> Tensor:
            if reorder is not None:
                self.decoder.reorder_incremental_state(cache, reorder)
                state["encoder_out"] = state["encoder_out"].index_select(1, reorder)
                state["padding"] = state["padding"].index_select(0, reorder)
            logits = self.decoder(tokens, state["encoder_out"], state["padding"], incremental_state=cache)
            return F.log_softmax(logits[:, -1, :].float(), dim=-1)

        try:
            hypotheses = beam_search(next_log_probs, bsz, beam, max_len, eos, pad, input_ids.device,
                                     min_len=settings.min_length or 1, len_penalty=settings.length_penalty)
        finally:
            self.set_beam_size(1)
        rows = [[eos] + h["tokens"].tolist() for sentence in hypotheses
                for h in sentence[: settings.num_return_sequences or 1]]
        out = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long, device=input_ids.device)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row)
        return out

    def set_beam_size(self, beam: int) -> None:
        """As fairseq's SequenceGenerator: routed encoder-decoder attention keeps one copy of the source keys
        and values per sentence, not per beam."""
        for module in self.modules():
            if isinstance(module, RoutedAttention) and module.encoder_decoder_attention:
                module.set_beam_size(beam)


class LMHead(nn.Module):
    """fairseq's ``RobertaLMHead``: dense, activation, layer norm, projection onto the token embeddings plus a bias."""

    def __init__(self, config: MoaFairseqConfig, embed_dim: int):
        super().__init__()
        self.dense, self.layer_norm = nn.Linear(embed_dim, embed_dim), nn.LayerNorm(embed_dim)
        self.weight = nn.Parameter(torch.zeros(config.vocab_size, embed_dim))
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.activation = ACTIVATIONS[config.activation_fn]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.layer_norm(self.activation(self.dense(x))), self.weight) + self.bias


class RobertaEncoder(nn.Module):
    """fairseq's ``RobertaEncoder``: ``sentence_encoder`` (a Transformer encoder) and ``lm_head``."""

    def __init__(self, config: MoaFairseqConfig):
        super().__init__()
        self.sentence_encoder = Encoder(config, config.encoder_stack)
        self.lm_head = LMHead(config, config.encoder_stack["embed_dim"])


class MoaFairseqForMaskedLM(MoaFairseqPreTrainedModel):
    """fairseq's RoBERTa masked LM (MoA, MoH, SwitchHead or dense self-attention)."""

    _tied_weights_keys = {"encoder.lm_head.weight": "encoder.sentence_encoder.embed_tokens.weight"}

    def __init__(self, config: MoaFairseqConfig):
        super().__init__(config)
        self.encoder = RobertaEncoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.sentence_encoder.embed_tokens

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                **kwargs) -> MoaModelOutput:
        """input_ids (B, T) with ``<mask>`` where masked; logits (B, T, V); ``labels`` (B, T): the original
        token where masked, -100 (or padding) elsewhere."""
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask.eq(0), self.config.pad_token_id)
        self.clear_routing()
        features = self.encoder.sentence_encoder(input_ids)[0].transpose(0, 1)
        return self.output(self.encoder.lm_head(features), labels, shift=False)


def routing_aux_loss(routings, weights: dict, zero: Tensor) -> Tensor:
    """The routers' auxiliary losses per token as the plugin's criteria add them: alpha L_a + beta L_z summed
    over MoA modules, beta_MoH times the mean L_b over MoH modules, nothing for SwitchHead."""
    moa = [r for r in routings if r.family == "MoA" and r.load_balancing_loss is not None]
    moh = [r for r in routings if r.family == "MoH" and r.balance_loss is not None]
    total = zero
    for r in moa:
        total = total + weights["moa_alpha"] * r.load_balancing_loss + weights["moa_beta"] * r.router_z_loss
    if moh:
        total = total + weights["moh_beta"] * torch.stack([r.balance_loss for r in moh]).mean()
    return total
