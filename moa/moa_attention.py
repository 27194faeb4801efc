"""The Mixture-of-Attention-heads module (MoA, Zhang et al. 2022, Sec. 3).

For a query token x_t routed to experts G(x_t) with gate weights w (see
:mod:`moa.routing`):

    q_{t,i} = x_t W_q^i                      (one query head per selected expert)
    K = X_kv W_k,  V = X_kv W_v              (ONE shared key/value head of width D)
    o_{t,i} = softmax(q_{t,i} K^T / sqrt(D)) V
    y_t = sum_{i in G(x_t)} w_{t,i} o_{t,i} W_o^i

The attention core is multi-query attention with k routed query heads per
token; the incremental-decoding cache holds the single shared head, (batch,
length, D). Only the selected experts' projections are computed, except in
incremental decoding and for k = E (see :meth:`MixtureOfAttentionHeads.mix`).

The module follows fairseq's ``MultiheadAttention`` contract through
:class:`~moa.routed_attention.RoutedAttention`.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .dispatch import ExpertDispatch
from .experts import ExpertLinear
from .routed_attention import RoutedAttention, attention_bias, attention_probs
from .routing import ExpertRouting, TopKRouter


class MixtureOfAttentionHeads(RoutedAttention):
    """MoA attention with ``num_experts`` experts, ``top_k`` per token, head width ``head_dim``.

    Parameters: router W_g (E x d_model), W_q (d_model x E x D), W_o (E x D x d_model),
    shared W_k (kdim -> D) and W_v (vdim -> D); biases only with ``bias=True``.

    After each forward, ``self.routing`` holds the :class:`~moa.routing.ExpertRouting`
    of the queries (auxiliary losses over non-padding tokens). Attention weights, when asked
    for, are averaged over the selected experts (batch, tgt_len, src_len), or per selected slot
    (top_k, batch, tgt_len, src_len) with ``need_head_weights``.
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
        router_init: str = "normal",
    ):
        super().__init__(embed_dim, head_dim, dropout, self_attention, encoder_decoder_attention)
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_heads = top_k  # fairseq's layers read .num_heads and .head_dim

        self.router = TopKRouter(embed_dim, num_experts, top_k, gate_weights, router_init)
        self.q_experts = ExpertLinear(num_experts, embed_dim, head_dim, bias, expert_dim=1)
        self.k_proj = nn.Linear(kdim or embed_dim, head_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, head_dim, bias=bias)
        self.o_experts = ExpertLinear(num_experts, head_dim, embed_dim, bias)
        for proj in (self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    path: Optional[str] = None  # None: by the rule of mix; "routed" or "dense" pins one (the tests compare them)

    def route(self, x: Tensor, padding: Optional[Tensor], aux: bool = True) -> Tuple[ExpertRouting, None]:
        return self.router(x, padding, aux), None

    def mix(self, x, routing: ExpertRouting, routed_queries, keys, values, bias, tgt_len, bsz, need_weights,
            need_head_weights, decoding):
        """y_t = sum_j w_j o_j W_o^{e_j} by one of two paths with the same output, chosen by the shape of
        the work: :meth:`_mix_routed` (each expert's projections on its own rows, k of E per token) for
        whole sequences, in training and without autograd alike; :meth:`_mix_dense` (every expert in one
        matmul each) when k = E, where there is nothing to skip, and in incremental decoding, where a step
        projects one token per hypothesis, so that each expert's group holds N k / E rows (64 at beam 4 x
        32 sentences, 4 of 8 experts): GEMMs that small run far below the speed of one (N, d_model) x
        (d_model, E D) product, which does E / k times the multiply-adds in less time
        (docs/how-it-works.md, "Paths chosen by the shape of the work"). ``self.path`` ("routed" or "dense") pins one."""
        args = (x, routing, keys, values, bias, tgt_len, bsz, need_weights, need_head_weights)
        dense = self.path == "dense" or (self.path is None and (self.top_k == self.num_experts or decoding))
        return self._mix_dense(*args) if dense else self._mix_routed(*args)

    def _mix_routed(self, x, routing: ExpertRouting, keys, values, bias, tgt_len, bsz, need_weights,
                    need_head_weights):
        """The selected experts' queries, multi-query attention over the shared head, and the gated
        output projections, each expert's projections applied to its own rows only."""
        plan = ExpertDispatch(routing.selected, self.num_experts, tgt_len, bsz)
        # Selected experts' queries, written straight into the (batch, k, tgt_len, D) layout.
        q = self.q_experts(x, plan.token, plan.slot_row, plan.counts, plan.num_slot_rows,
                           dst_is_permutation=True, experts=plan.expert)
        q = q.view(bsz, self.top_k, tgt_len, self.head_dim)
        o, weights = self._attend(q, keys, values, bias, need_weights, need_head_weights)
        # The gate scales each gathered row inside the projection.
        gates = routing.gates.reshape(-1)[plan.order]
        y = self.o_experts(o.reshape(plan.num_slot_rows, self.head_dim), plan.slot_row, plan.token,
                           plan.counts, plan.num_tokens, scale=gates, add_bias=False, experts=plan.expert)
        if self.o_experts.bias is not None:  # sum_j w_j b_o^{e_j}
            y = y + (routing.gates.unsqueeze(-1) * self.o_experts.bias[routing.selected]).sum(dim=1)
        return y, weights

    def _mix_dense(self, x, routing, keys, values, bias, tgt_len, bsz, need_weights, need_head_weights):
        """The same output with no gathers: every expert's query and output projection as one matmul each
        (E/k times the routed path's projection multiply-adds) and attention for every expert's query, the
        unselected experts' outputs gated by zero. Weights, when asked for, are the selected experts', in
        slot order as on the routed path (in expert order when k = E)."""
        num_tokens, e, d = x.size(0), self.num_experts, self.head_dim
        gates = routing.gates.new_zeros(num_tokens, e).scatter(1, routing.selected, routing.gates)  # (N, E)
        q = self.q_experts.fan_out(x).view(tgt_len, bsz, e, d).permute(1, 2, 0, 3)  # (B, E, T, D)
        o, weights = self._attend(q, keys, values, bias, need_weights, need_head_weights=True)
        o = (o * gates.view(tgt_len, bsz, e).permute(1, 2, 0).unsqueeze(-1)).permute(2, 0, 1, 3)
        y = self.o_experts.fan_in(o.reshape(num_tokens, e, d))
        if self.o_experts.bias is not None:  # sum_j w_j b_o^{e_j}
            y = y + gates @ self.o_experts.bias
        if weights is not None:  # (E, B, T, S), every expert's
            if self.top_k < e:  # the selected experts', slot by slot: (k, B, T, S)
                slots = routing.selected.view(tgt_len, bsz, -1).permute(2, 1, 0)  # (k, B, T)
                weights = weights.gather(0, slots.unsqueeze(-1).expand(-1, -1, -1, weights.size(-1)))
            weights = weights if need_head_weights else weights.mean(dim=0)
        return y, weights

    def _attend(self, q, keys, values, bias, need_weights: bool, need_head_weights: bool):
        """Multi-query attention of h query heads (k slots, or all E experts) over the one shared K/V head.

        q: (B, h, T, D); keys, values: (B, S, D); bias: additive, broadcastable to
        (B, 1, T, S), or None. The h heads are folded into the query length, (B, 1, h*T, D),
        so K and V are read as they are, never repeated per head.
        Returns o (B, h, T, D) and the weights asked for: (h, B, T, S) with ``need_head_weights``,
        else their mean over the heads (B, T, S).
        """
        bsz, top_k, tgt_len, head_dim = q.shape
        if bias is not None and bias.size(-2) > 1:  # a per-query mask: the same for every head
            bias = bias.unsqueeze(2).expand(-1, -1, top_k, -1, -1).reshape(bias.size(0), 1, -1, bias.size(-1))
        o, probs = self.attention_core(q.reshape(bsz, 1, top_k * tgt_len, head_dim), keys.unsqueeze(1),
                                       values.unsqueeze(1), bias, need_weights)
        o = o.view(bsz, top_k, tgt_len, head_dim)
        if probs is None:
            return o, None
        probs = probs.view(bsz, top_k, tgt_len, -1)
        return o, probs.transpose(0, 1) if need_head_weights else probs.mean(dim=1)

    def head_outputs(self, query, key, key_padding_mask=None, attn_mask=None):
        """Every expert's attention over the shared head and its ``A V W_o^i``, ungated (see the base)."""
        tgt_len, bsz, _ = query.shape
        q = self.q_experts.fan_out(query.reshape(tgt_len * bsz, -1)).view(tgt_len, bsz, self.num_experts,
                                                                           self.head_dim).permute(1, 2, 0, 3)
        k, v = (t.unsqueeze(1) for t in self._project_key_value(key, key))  # (B, 1, S, D)
        attention = attention_probs(q, k, attention_bias(attn_mask, key_padding_mask, q.dtype), self.scaling)
        return attention, torch.matmul(torch.matmul(attention, v), self.o_experts.weight[None])

    def active_heads(self):
        return "MoA", self.top_k, self.num_experts

    def _project_key_value(self, key: Tensor, value: Tensor):
        """The one shared K/V head: (src_len, batch, dim) -> (batch, src_len, D) each."""
        return self.k_proj(key).transpose(0, 1), self.v_proj(value).transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"{self.top_k}K{self.num_experts}E{self.head_dim}D, embed_dim={self.embed_dim}, "
                f"self_attention={self.self_attention}, encoder_decoder_attention={self.encoder_decoder_attention}")
