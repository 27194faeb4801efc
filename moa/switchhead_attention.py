"""SwitchHead attention (Csordas, Piekos, Irie, Schmidhuber, NeurIPS 2024, Sec. 3).

A few heads h = 1..H, each with its own dense query and key projection and one attention matrix; the
value and output projections of each head are mixtures of E experts, k chosen per token by
non-competitive sigmoid selection (:class:`~moa.routing.SigmoidTopKRouter`), the scores themselves the
weights. The value experts are chosen from the key/value source tokens, the output experts from the
query tokens. For a query token x_t and source tokens x_s:

    q_{t,h} = x_t W_q^h,  k_{s,h} = x_s W_k^h
    v_{s,h} = sum_{e in V_s^h} s^V_{s,h,e} x_s W_v^{h,e}       (value experts: once per source token)
    a_{t,h} = softmax(q_{t,h} K_h^T / sqrt(D)) V_h
    y_t = sum_h sum_{e in O_t^h} s^O_{t,h,e} a_{t,h} W_o^{h,e}

with no biases and no auxiliary loss. With E = 1 the value projection is dense and ungated and each
head's output is gated by sigmoid(x_t w_o^h), as in the released layer. The incremental-decoding cache
holds every head's keys and (mixed) values, (batch, H, length, D) each: the value experts run once per
source token, like the keys.

Parameters, and the released ``SwitchHeadCore``'s names they load from: ``q_proj`` / ``k_proj``
(``q``, ``k``: H*D x d), ``v_experts`` ((d, H*E, D); ``v`` is (H*E, d, D)), ``o_experts`` ((H*E, D, d),
``o``), ``value_router`` / ``output_router`` (``sel_v`` / ``sel_o``, H*E x d); expert e of head h is
row h*E + e everywhere. The released layer applies dropout to the queries; this one, as fairseq's
attention, to the attention probabilities.

The module follows fairseq's ``MultiheadAttention`` contract through
:class:`~moa.routed_attention.RoutedAttention`.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .dispatch import HeadExpertDispatch
from .experts import ExpertLinear, expert_linear
from .routed_attention import RoutedAttention, attention_bias, attention_probs
from .routing import SigmoidTopKRouter, SwitchHeadRouting


class SwitchHeadAttention(RoutedAttention):
    """SwitchHead attention: ``num_heads`` heads of width ``head_dim``, each with ``num_experts`` value and
    output experts of which ``top_k`` are active per token. ``expert_dropout``: see
    :class:`~moa.routing.SigmoidTopKRouter`.

    After each forward, ``self.routing`` holds the :class:`~moa.routing.SwitchHeadRouting` of the output
    experts (the queries'). Attention weights, when asked for, are averaged over the heads (batch,
    tgt_len, src_len), or per head (num_heads, batch, tgt_len, src_len) with ``need_head_weights``.
    """

    time_dim = 2  # cached keys/values: (batch, heads, len, D)

    def __init__(self, embed_dim: int, num_heads: int, num_experts: int, top_k: int, head_dim: int,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, dropout: float = 0.0,
                 self_attention: bool = False, encoder_decoder_attention: bool = False, expert_dropout: float = 0.0):
        super().__init__(embed_dim, head_dim, dropout, self_attention, encoder_decoder_attention)
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        self.num_heads, self.num_experts, self.top_k = num_heads, num_experts, top_k
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kdim, num_heads * head_dim, bias=False)
        self.value_router = SigmoidTopKRouter(kdim, num_heads, num_experts, top_k, expert_dropout) \
            if num_experts > 1 else None
        self.output_router = SigmoidTopKRouter(embed_dim, num_heads, num_experts, top_k, expert_dropout)
        self.v_experts = ExpertLinear(num_heads * num_experts, vdim, head_dim, expert_dim=1)
        self.o_experts = ExpertLinear(num_heads * num_experts, head_dim, embed_dim)
        with torch.no_grad():  # the released layer's initialisation (init_scale 1)
            for weight, fan_in in ((self.q_proj.weight, embed_dim), (self.k_proj.weight, kdim),
                                   (self.v_experts.weight, vdim), (self.o_experts.weight, num_heads * head_dim)):
                nn.init.normal_(weight, std=fan_in ** -0.5)

    path: Optional[str] = None  # None: by the rule of _dense; "routed" or "dense" pins one (the tests compare them)

    def _dense(self, decoding: bool) -> bool:
        """Every expert in one matmul (E/k times the multiply-adds, no gathers) when k = E, where nothing is
        skipped, and in a decoding step (one token per hypothesis, a beam's few with beam-folded
        encoder-decoder attention), where each expert's group would hold a few rows; else each expert on its
        own rows (the grouped GEMM)."""
        if self.path is not None:
            return self.path == "dense"
        return self.top_k == self.num_experts or decoding

    def route(self, x: Tensor, padding: Optional[Tensor], aux: bool = True) -> Tuple[SwitchHeadRouting, None]:
        return self.output_router(x, padding, aux), None

    def mix(self, x, routing: SwitchHeadRouting, routed_queries, keys, values, bias, tgt_len, bsz, need_weights,
            need_head_weights, decoding):
        """Every head's attention over its keys and mixed values, then the selected output experts."""
        q = self.q_proj(x).view(tgt_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # (B, H, T, D)
        o, probs = self.attention_core(q, keys, values, bias, need_weights or need_head_weights)
        y = self._mixed_output(o, routing, tgt_len, bsz, decoding)
        if probs is None:
            return y, None
        return y, probs.transpose(0, 1) if need_head_weights else probs.mean(dim=1)

    def _mixed_output(self, o: Tensor, routing: SwitchHeadRouting, tgt_len: int, bsz: int, decoding: bool) -> Tensor:
        """o (B, H, T, D) -> (T * B, embed_dim): sum over heads and selected experts of s a W_o^{h,e}."""
        if self._dense(decoding):
            heads = o.permute(2, 0, 1, 3).reshape(tgt_len * bsz, self.num_heads, 1, self.head_dim)
            gated = heads * self._full_gates(routing).unsqueeze(-1)  # (N, H, E, D)
            return self.o_experts.fan_in(gated.reshape(gated.size(0), -1, self.head_dim))
        plan = HeadExpertDispatch(routing.selected, self.num_heads, self.num_experts, tgt_len, bsz)
        gates = routing.gates.reshape(-1)[plan.order]
        return self.o_experts(o.reshape(-1, self.head_dim), plan.head_row, plan.token, plan.counts,
                              tgt_len * bsz, scale=gates, experts=plan.expert)

    def _full_gates(self, routing: SwitchHeadRouting) -> Tensor:
        """(N, H, E): each expert's gate, zero where not selected."""
        num_tokens = routing.selected.size(0)
        return routing.gates.new_zeros(num_tokens, self.num_heads * self.num_experts).scatter(
            1, routing.selected, routing.gates).view(num_tokens, self.num_heads, self.num_experts)

    def _project_key_value(self, key: Tensor, value: Tensor):
        """Every head's keys and mixed values: (src_len, batch, dim) -> (batch, H, src_len, D) each; the value
        experts are chosen from ``key`` (the released layer's k_src), applied to ``value``."""
        src_len, bsz = key.shape[:2]
        keys = self.k_proj(key).view(src_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        rows = value.reshape(src_len * bsz, -1)
        if self.value_router is None:  # E = 1: a dense, ungated value projection
            values = self.v_experts.fan_out(rows)
        else:
            routing = self.value_router(key.reshape(src_len * bsz, -1), aux=False)
            if self._dense(src_len == 1):  # a self-attention decoding step's one new key per hypothesis
                values = (self.v_experts.fan_out(rows).view(rows.size(0), self.num_heads, self.num_experts, -1)
                          * self._full_gates(routing).unsqueeze(-1)).sum(dim=2)
            else:
                plan = HeadExpertDispatch(routing.selected, self.num_heads, self.num_experts, src_len, bsz)
                gates = routing.gates.reshape(-1)[plan.order]
                values = expert_linear(rows, self.v_experts.weight, None, plan.token, plan.head_row, plan.counts,
                                       bsz * self.num_heads * src_len, scale=gates, expert_dim=1, experts=plan.expert,
                                       scale_output=True)
                return keys, values.view(bsz, self.num_heads, src_len, self.head_dim)
        return keys, values.reshape(src_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def head_outputs(self, query, key, key_padding_mask=None, attn_mask=None):
        """Every head's attention (B, H, T, S) and its output contribution (B, H, T, C): a head has no
        output projection but its selected experts', so the contribution is gated, sum_e s a W_o^{h,e}."""
        tgt_len, bsz, _ = query.shape
        keys, values = self._project_key_value(key, key)
        q = self.q_proj(query).view(tgt_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        attention = attention_probs(q, keys, attention_bias(attn_mask, key_padding_mask, q.dtype), self.scaling)
        gates = self._full_gates(self.output_router(query.reshape(tgt_len * bsz, -1), aux=False))
        gates = gates.view(tgt_len, bsz, self.num_heads, self.num_experts).permute(1, 2, 0, 3)  # (B, H, T, E)
        w_o = self.o_experts.weight.view(self.num_heads, self.num_experts, self.head_dim, -1)
        return attention, torch.einsum("bhtd,bhte,hedc->bhtc", torch.matmul(attention, values), gates, w_o)

    def active_heads(self):
        return "SwitchHead", self.num_heads * self.top_k, self.num_heads * self.num_experts

    def load_released_state_dict(self, state: dict) -> None:
        """Copy the weights of the released ``SwitchHeadCore`` (its ``state_dict()``: q, k, v, o, sel_v, sel_o)
        of the same shape into this module."""
        h, e, d = self.num_heads, self.num_experts, self.head_dim
        with torch.no_grad():
            self.q_proj.weight.copy_(state["q.weight"])
            self.k_proj.weight.copy_(state["k.weight"])
            self.output_router.weight.copy_(state["sel_o"])
            if e > 1:
                self.value_router.weight.copy_(state["sel_v"])
                self.v_experts.weight.copy_(state["v"].transpose(0, 1))  # (H*E, d, D) -> (d, H*E, D)
                self.o_experts.weight.copy_(state["o"])
            else:  # nn.Linear-shaped: v (H*D, d), o (d, H*D)
                self.v_experts.weight.copy_(state["v"].view(h, d, -1).permute(2, 0, 1))
                self.o_experts.weight.copy_(state["o"].t().reshape(h, d, -1))

    def extra_repr(self) -> str:
        return (f"{notation(self.num_heads, self.top_k, self.num_experts, self.head_dim)}, embed_dim={self.embed_dim}, "
                f"self_attention={self.self_attention}, encoder_decoder_attention={self.encoder_decoder_attention}")


def notation(heads: int, top_k: int, experts: int, head_dim: int) -> str:
    """A SwitchHead configuration in the MoA paper's kKeEdD style with the heads first: ``2H2K4E64D`` is
    2 heads of width 64, each choosing 2 of 4 value and 2 of 4 output experts per token."""
    return f"{heads}H{top_k}K{experts}E{head_dim}D"

