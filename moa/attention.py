"""The Mixture-of-Attention-heads module (MoA, Zhang et al. 2022, Sec. 3).

For a query token x_t routed to experts G(x_t) with gate weights w (see
:mod:`moa.routing`):

    q_{t,i} = x_t W_q^i                      (one query head per selected expert)
    K = X_kv W_k,  V = X_kv W_v              (ONE shared key/value head of width D)
    o_{t,i} = softmax(q_{t,i} K^T / sqrt(D)) V
    y_t = sum_{i in G(x_t)} w_{t,i} o_{t,i} W_o^i

The attention core is multi-query attention with k routed query heads per
token; the incremental-decoding cache holds the single shared head, (batch,
length, D). Only the selected experts' projections are computed.

The module follows fairseq's ``MultiheadAttention`` contract (time-first
inputs, ``(output, weights_or_None)``, incremental state, beam reordering) so
that fairseq's Transformer layers use it unchanged.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

from moa.experts import ExpertDispatch, ExpertLinear
from moa.routing import Routing, TopKRouter

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


@with_incremental_state
class MixtureOfAttentionHeads(nn.Module):
    """MoA attention with ``num_experts`` experts, ``top_k`` per token, head width ``head_dim``.

    Parameters: router W_g (E x d_model), W_q (d_model x E x D), W_o (E x D x d_model),
    shared W_k (kdim -> D) and W_v (vdim -> D); biases only with ``bias=True``.

    After each forward, ``self.routing`` holds the :class:`~moa.routing.Routing`
    of the queries (auxiliary losses over non-padding tokens); criterions read it
    through :func:`moa.criterions.aux_loss.pop_routings`.

    Query padding: for self-attention it is ``key_padding_mask``; for
    encoder-decoder attention the decoder sets ``query_padding_mask`` (batch,
    tgt_len) before running its layers, since fairseq passes only key padding.
    """

    def __init__(
        self,
        embed_dim: int,
        num_experts: int,
        top_k: int,
        head_dim: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = False,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
        gate_weights: str = "renormalized",
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.head_dim = head_dim
        self.num_heads = top_k  # fairseq's layers read .num_heads and .head_dim
        self.scaling = head_dim ** -0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)

        self.router = TopKRouter(embed_dim, num_experts, top_k, gate_weights)
        self.q_experts = ExpertLinear(num_experts, embed_dim, head_dim, bias, expert_dim=1)
        self.k_proj = nn.Linear(kdim or embed_dim, head_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, head_dim, bias=bias)
        self.o_experts = ExpertLinear(num_experts, head_dim, embed_dim, bias)
        for proj in (self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

        self.query_padding_mask: Optional[Tensor] = None
        self.routing: Optional[Routing] = None

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: (tgt_len, batch, embed_dim); key/value: (src_len, batch, kdim/vdim).

        key_padding_mask: (batch, src_len), True/1 at padding. attn_mask: (tgt_len,
        src_len), additive float (fairseq's -inf future mask) or bool (True = blocked).
        Returns output (tgt_len, batch, embed_dim) and, when asked for, attention
        weights averaged over the selected experts (batch, tgt_len, src_len), or per
        selected slot (top_k, batch, tgt_len, src_len) with ``need_head_weights``.
        """
        if before_softmax:
            raise NotImplementedError("MixtureOfAttentionHeads does not return pre-softmax scores")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(f"query has {embed_dim} features, the module expects {self.embed_dim}")

        keys, values, key_padding_mask = self._shared_key_value(
            key, value, key_padding_mask, incremental_state, static_kv
        )

        # Route the queries; tokens are flattened time-first: n = t * bsz + b.
        x = query.reshape(tgt_len * bsz, embed_dim)
        routing = self.router(x, self._flat_query_padding(key_padding_mask, incremental_state, tgt_len, bsz))
        self.routing = routing
        bias = _attention_bias(attn_mask, key_padding_mask, query.dtype)
        if self.top_k == self.num_experts:
            return self._forward_all_experts(x, routing, keys, values, bias, tgt_len, bsz, need_weights,
                                             need_head_weights)
        plan = ExpertDispatch(routing.experts, self.num_experts, tgt_len, bsz)
        # Selected experts' queries, written straight into the (batch, k, tgt_len, D) layout.
        q = self.q_experts(x, plan.token, plan.slot_row, plan.group_sizes, plan.num_slot_rows,
                           dst_is_permutation=True)
        q = q.view(bsz, self.top_k, tgt_len, self.head_dim)
        o, weights = self._attend(q, keys, values, bias, need_weights, need_head_weights)
        # y_t = sum_j w_j o_j W_o^{e_j}: the gate scales each gathered row inside the projection.
        gates = routing.weights.reshape(-1)[plan.order]
        y = self.o_experts(o.reshape(plan.num_slot_rows, self.head_dim), plan.slot_row, plan.token,
                           plan.group_sizes, plan.num_tokens, scale=gates, add_bias=False)
        if self.o_experts.bias is not None:  # sum_j w_j b_o^{e_j}
            y = y + (routing.weights.unsqueeze(-1) * self.o_experts.bias[routing.experts]).sum(dim=1)
        return y.view(tgt_len, bsz, self.embed_dim), weights

    def _forward_all_experts(self, x, routing, keys, values, bias, tgt_len, bsz, need_weights,
                             need_head_weights):
        """top_k == E: every expert is selected for every token, so slot order is irrelevant; the
        projections run as two dense matmuls (the same FLOPs as the routed path, no gathers)."""
        gates = torch.zeros_like(routing.weights).scatter(1, routing.experts, routing.weights)  # (N, E)
        q = self.q_experts.fan_out(x).view(tgt_len, bsz, self.num_experts, self.head_dim).permute(1, 2, 0, 3)
        o, weights = self._attend(q, keys, values, bias, need_weights, need_head_weights)
        o = o * gates.view(tgt_len, bsz, self.num_experts).permute(1, 2, 0).unsqueeze(-1)
        y = self.o_experts.fan_in(o.permute(2, 0, 1, 3).reshape(tgt_len * bsz, self.num_experts, self.head_dim))
        if self.o_experts.bias is not None:
            y = y + gates @ self.o_experts.bias
        return y.view(tgt_len, bsz, self.embed_dim), weights

    def _attend(self, q, keys, values, bias, need_weights: bool, need_head_weights: bool):
        """Multi-query attention of k query heads over the one shared K/V head.

        q: (B, k, T, D); keys, values: (B, S, D); bias: additive, broadcastable to
        (B, 1, T, S), or None. The k heads are folded into the query length, (B, 1, k*T, D),
        so K and V are read as they are, never repeated per head.
        Returns o (B, k, T, D) and the weights asked for.
        """
        bsz, top_k, tgt_len, head_dim = q.shape
        q = q.reshape(bsz, 1, top_k * tgt_len, head_dim)
        keys, values = keys.unsqueeze(1), values.unsqueeze(1)
        if bias is not None and bias.size(-2) > 1:  # a per-query mask: the same for every head
            bias = bias.unsqueeze(2).expand(-1, -1, top_k, -1, -1).reshape(bias.size(0), 1, -1, bias.size(-1))
        if not need_weights:
            dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropout, scale=self.scaling)
            return o.view(bsz, top_k, tgt_len, head_dim), None
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling
        if bias is not None:
            scores = scores + bias
        probs = utils.softmax(scores, dim=-1).type_as(scores)  # (B, 1, k*T, S)
        o = torch.matmul(self.dropout_module(probs), values).view(bsz, top_k, tgt_len, head_dim)
        probs = probs.view(bsz, top_k, tgt_len, -1)
        return o, probs.transpose(0, 1) if need_head_weights else probs.mean(dim=1)

    def _shared_key_value(self, key, value, key_padding_mask, incremental_state, static_kv):
        """Project the shared K/V head, (batch, src_len, D), through the incremental cache."""
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if static_kv and saved is not None and "prev_key" in saved:
            return saved["prev_key"], saved["prev_value"], key_padding_mask
        if key is None or value is None:
            raise ValueError("MixtureOfAttentionHeads needs key and value unless they are cached (static_kv)")
        keys = self.k_proj(key).transpose(0, 1)
        values = self.v_proj(value).transpose(0, 1)
        if saved is not None:
            if not static_kv and "prev_key" in saved:
                prev_len = saved["prev_key"].size(1)
                keys = torch.cat([saved["prev_key"], keys], dim=1)
                values = torch.cat([saved["prev_value"], values], dim=1)
                key_padding_mask = _cat_padding(saved.get("prev_key_padding_mask"), key_padding_mask,
                                                keys.size(0), prev_len, keys.size(1) - prev_len)
            saved["prev_key"], saved["prev_value"] = keys, values
            if not static_kv:
                saved["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved)
        return keys, values, key_padding_mask

    def _flat_query_padding(self, key_padding_mask, incremental_state, tgt_len, bsz) -> Optional[Tensor]:
        """(tgt_len * bsz,) bool padding of the queries, or None when unknown/none."""
        mask = self.query_padding_mask
        if mask is None and self.self_attention and incremental_state is None:
            mask = key_padding_mask
        if mask is None:
            return None
        if mask.shape != (bsz, tgt_len):
            raise ValueError(f"query padding mask has shape {tuple(mask.shape)}, expected {(bsz, tgt_len)}")
        return mask.bool().transpose(0, 1).reshape(-1)

    def reorder_incremental_state(self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor):
        """Re-index every cached tensor along the batch dimension (beam search)."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer:
            for name, cached in buffer.items():
                if cached is not None:
                    buffer[name] = cached.index_select(0, new_order)
            incremental_state = self._set_input_buffer(incremental_state, buffer)
        return incremental_state

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def extra_repr(self) -> str:
        return (f"{self.top_k}K{self.num_experts}E{self.head_dim}D, embed_dim={self.embed_dim}, "
                f"self_attention={self.self_attention}, encoder_decoder_attention={self.encoder_decoder_attention}")


def _cat_padding(prev: Optional[Tensor], new: Optional[Tensor], bsz: int, prev_len: int, new_len: int):
    """Concatenate cached and new key padding masks (batch, len); None when neither has padding."""
    if prev is None and new is None:
        return None
    device = (prev if prev is not None else new).device
    if prev is None:
        prev = torch.zeros(bsz, prev_len, dtype=torch.bool, device=device)
    if new is None:
        new = torch.zeros(bsz, new_len, dtype=torch.bool, device=device)
    return torch.cat([prev.bool(), new.bool()], dim=1)


def _attention_bias(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """fairseq's masks as one additive bias: attn_mask (T, S) float (-inf blocks) or bool
    (True blocks), key_padding_mask (B, S) (True/1 at padding) -> (1 or B, 1, T or 1, S)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf"))
        else:
            bias = attn_mask.to(dtype)
        bias = bias[None, None]
    if key_padding_mask is not None:
        padding = key_padding_mask.bool()[:, None, None, :]
        if bias is None:
            bias = torch.zeros(padding.shape, dtype=dtype, device=padding.device)
        bias = bias.masked_fill(padding, float("-inf"))
    return bias
