"""Models trained with the moa fairseq plugin, in Hugging Face ``transformers`` (``moa-export-hf``).

Imports torch, transformers and the plugin's torch-only attention layers beside it (relative imports, so
the files travel with an exported model and load with ``trust_remote_code=True``: no fairseq, no moa).
The network is fairseq's, module for module and with fairseq's parameter names, so a fairseq state dict
loads as it is and the outputs are fairseq's:

* :class:`MoaFairseqForCausalLM`: fairseq's ``transformer_lm`` decoder (token embeddings scaled by
  sqrt(d), sinusoidal or learned positions from fairseq's position numbering, post- or pre-norm layers,
  tied or separate output projection) with MoA, MoH, SwitchHead or fairseq's multi-head self-attention.

A forward with ``labels`` returns the mean cross-entropy of the next tokens plus the routers' auxiliary
losses as the plugin's ``moa_cross_entropy`` weighs them (MoA: alpha L_a + beta L_z per module; MoH:
beta times the mean L_b; SwitchHead: none), so ``transformers.Trainer`` fine-tunes with the training
objective; ``routing`` in the output holds each routed module's decision (load, gates, auxiliary losses).
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_moa_fairseq import MoaFairseqConfig
from .moa_attention import MixtureOfAttentionHeads
from .moh_attention import MixtureOfHeadsAttention
from .routed_attention import RoutedAttention
from .switchhead_attention import SwitchHeadAttention

ATTENTION = {"moa": MixtureOfAttentionHeads, "moh": MixtureOfHeadsAttention, "switchhead": SwitchHeadAttention}
AUX_WEIGHTS = {"moa_alpha": 0.01, "moa_beta": 0.001, "moh_beta": 0.01}  # the plugin criteria's defaults


class MultiheadSelfAttention(nn.Module):
    """fairseq's ``MultiheadAttention`` as self-attention (its parameter names; q scaled by D^-1/2)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = num_heads, embed_dim // num_heads, dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.routing = None

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Tensor:
        """x: (T, B, C) -> (T, B, C); masks as fairseq's (key padding True at padding; additive future mask)."""
        tgt_len, bsz, dim = x.shape

        def split(t):
            return t.view(tgt_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        bias = attn_mask[None, None] if attn_mask is not None else None
        if key_padding_mask is not None:
            padding = torch.zeros(key_padding_mask.shape, dtype=x.dtype, device=x.device).masked_fill(
                key_padding_mask.bool(), float("-inf"))[:, None, None, :]
            bias = padding if bias is None else bias + padding
        o = F.scaled_dot_product_attention(split(self.q_proj(x) * self.head_dim ** -0.5), split(self.k_proj(x)),
                                           split(self.v_proj(x)), attn_mask=bias, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(tgt_len, bsz, dim))


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


class DecoderLayer(nn.Module):
    """fairseq's ``TransformerDecoderLayerBase`` without encoder attention: self-attention and FFN blocks,
    each with dropout, a residual and a layer norm before (``normalize_before``) or after."""

    def __init__(self, config: MoaFairseqConfig, layer: int):
        super().__init__()
        d = config.embed_dim
        if config.family == "transformer":
            self.self_attn = MultiheadSelfAttention(d, config.attention_heads, config.attention_dropout)
        else:
            self.self_attn = ATTENTION[config.family](d, **config.layer_attention(layer),
                                                      dropout=config.attention_dropout, self_attention=True)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, config.ffn_dim), nn.Linear(config.ffn_dim, d)
        self.activation = F.gelu if config.activation_fn.startswith("gelu") else F.relu
        self.config = config

    def forward(self, x: Tensor, padding: Optional[Tensor], future: Tensor) -> Tensor:
        c = self.config
        residual = x
        if c.normalize_before:
            x = self.self_attn_layer_norm(x)
        if isinstance(self.self_attn, RoutedAttention):
            x = self.self_attn(x, x, x, key_padding_mask=padding, attn_mask=future, need_weights=False)[0]
        else:
            x = self.self_attn(x, padding, future)
        x = residual + F.dropout(x, c.dropout, self.training)
        if not c.normalize_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if c.normalize_before:
            x = self.final_layer_norm(x)
        x = F.dropout(self.activation(self.fc1(x)), c.activation_dropout, self.training)
        x = residual + F.dropout(self.fc2(x), c.dropout, self.training)
        if not c.normalize_before:
            x = self.final_layer_norm(x)
        return x


class Decoder(nn.Module):
    """fairseq's ``TransformerDecoderBase`` as a language model's decoder (no encoder)."""

    def __init__(self, config: MoaFairseqConfig):
        super().__init__()
        d, pad = config.embed_dim, config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=pad)
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.embed_positions = None
        if config.token_positions and config.learned_positions:
            self.embed_positions = nn.Embedding(config.max_positions + pad + 1, d, padding_idx=pad)
        self.sinusoidal: Optional[Tensor] = None  # fairseq's table, made on first use (not a buffer: nothing to load)
        self.layernorm_embedding = nn.LayerNorm(d) if config.layernorm_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.layers))
        self.layer_norm = nn.LayerNorm(d) if config.final_layer_norm else None
        self.output_projection = nn.Linear(d, config.vocab_size, bias=False)
        self.config = config

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (B, T) -> logits (B, T, V)."""
        c = self.config
        x = self.embed_scale * self.embed_tokens(tokens)
        positions = positions_of(tokens, c.pad_token_id)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        elif c.token_positions:
            rows = max(int(positions.max()) + 1, c.max_positions + c.pad_token_id + 1)
            if self.sinusoidal is None or self.sinusoidal.size(0) < rows or self.sinusoidal.device != x.device:
                self.sinusoidal = sinusoidal_positions(rows, c.embed_dim, c.pad_token_id).to(x.device)
            x = x + self.sinusoidal.to(x.dtype)[positions]
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = F.dropout(x, c.dropout, self.training).transpose(0, 1)
        padding = tokens.eq(c.pad_token_id)
        padding = padding if padding.any() else None
        length = tokens.size(1)
        future = torch.triu(torch.full((length, length), float("-inf"), device=x.device, dtype=x.dtype), 1)
        for layer in self.layers:
            x = layer(x, padding, future)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.output_projection(x.transpose(0, 1))


@dataclass
class MoaCausalLMOutput(ModelOutput):
    """``loss`` (the training objective: task loss plus auxiliary terms), ``logits`` (B, T, V), ``lm_loss``
    (the cross-entropy alone, nats per token), ``aux_loss`` and ``routing`` (each routed module's decision)."""

    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    lm_loss: Optional[Tensor] = None
    aux_loss: Optional[Tensor] = None
    routing: Optional[List] = None


class MoaFairseqPreTrainedModel(PreTrainedModel):
    config_class = MoaFairseqConfig
    base_model_prefix = "decoder"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):  # weights come from the fairseq checkpoint; fresh models use torch's defaults
        pass


class MoaFairseqForCausalLM(MoaFairseqPreTrainedModel, GenerationMixin):
    """A fairseq ``transformer_lm``-style language model (MoA, MoH, SwitchHead or dense self-attention)."""

    _tied_weights_keys = {"decoder.output_projection.weight": "decoder.embed_tokens.weight"}

    def __init__(self, config: MoaFairseqConfig):
        super().__init__(config)
        self.decoder = Decoder(config)
        self.aux_weights = dict(AUX_WEIGHTS)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embed_tokens

    def set_input_embeddings(self, value):
        self.decoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.decoder.output_projection

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                **kwargs) -> MoaCausalLMOutput:
        """input_ids: (B, T) fairseq dictionary ids (padding: ``pad_token_id``, as fairseq pads; a given
        ``attention_mask`` marks padding with 0 and is applied as fairseq's padding). ``labels``: (B, T),
        the next token of each position is predicted (shifted here, as transformers' causal LMs do);
        -100 or padding is ignored."""
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask.eq(0), self.config.pad_token_id)
        for module in self.modules():
            if isinstance(module, RoutedAttention):
                module.routing = None
        logits = self.decoder(input_ids)
        routing = [m.routing for m in self.modules() if isinstance(m, RoutedAttention) and m.routing is not None]
        loss = lm_loss = aux = None
        if labels is not None:
            target = labels[:, 1:].masked_fill(labels[:, 1:].eq(self.config.pad_token_id), -100)
            lm_loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), target.reshape(-1),
                                      ignore_index=-100)
            aux = routing_aux_loss(routing, self.aux_weights, logits.new_zeros((), dtype=torch.float32))
            loss = lm_loss + aux
        return MoaCausalLMOutput(loss=loss, logits=logits, lm_loss=lm_loss, aux_loss=aux, routing=routing)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """Every step runs the whole prefix (no key/value cache yet)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}


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
