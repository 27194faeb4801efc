"""Mixture-of-Head attention (MoH, Jin et al. 2025, Sec. 3.2).

The h heads of ordinary multi-head attention are the experts: the first h_s are shared (always
active), and of the other E = h - h_s routed heads a router picks the top-K per token (see
:class:`~moa.routing.TwoStageHeadRouter` for the gates g). For a query token x_t:

    q_{t,i} = x_t W_Q^i,  K_i = X W_K^i,  V_i = X W_V^i          (every head's K/V, once per token)
    H_{t,i} = softmax(q_{t,i} K_i^T / sqrt(D)) V_i
    y_t = sum_i g_{t,i} H_{t,i} W_O^i + b_O                       (gate before the output projection)

Parameters keep fairseq's ``MultiheadAttention`` names and shapes (``q_proj``, ``k_proj``,
``v_proj``, ``out_proj``, with biases), so a Transformer checkpoint's attention weights load
unchanged; the router adds d_model * (h + 2) weights.

Only active (token, head) pairs cost work. The shared heads run as ordinary multi-head attention.
For the routed heads, the (token, slot) assignments are packed per (batch row, head): each group
holds the selected queries of one row for one head, in time order, padded to the longest group of
the batch (not to the sequence length), and attends over that head's keys with a mask built from
the queries' positions (causal and padding masks stay exact). The query and output projections of
the routed heads go through :func:`~moa.experts.expert_linear`, so an unselected head's W_Q^i and
W_O^i are never applied to that token. Computing every head and multiplying by the gates (zero for
unselected heads), as the released code does, is the other path: when every routed head is active
anyway (K = E) or none is (K = 0: the shared heads alone), and in incremental decoding (:meth:`mix`).

``router="query-norm"`` replaces the learned router with the parameter-free one of converted models
(:class:`~moa.routing.QueryNormHeadRouter`): it needs every routed head's query to score them, so
every head's query is projected once, for the router and for attention.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import HeadPacking
from .experts import expert_linear
from .routed_attention import RoutedAttention, attention_bias, attention_probs
from .routing import HEAD_ROUTERS, HeadRouting, QueryNormHeadRouter, TwoStageHeadRouter


class MixtureOfHeadsAttention(RoutedAttention):
    """MoH attention: ``num_heads`` heads of width embed_dim / num_heads, ``shared_heads`` always
    active, ``top_k`` of the rest per token. ``router``: ``learned`` (the paper's two-stage router;
    ``gate_scale`` and ``balance_loss``: see :class:`~moa.routing.TwoStageHeadRouter`) or
    ``query-norm`` (:class:`~moa.routing.QueryNormHeadRouter`, no parameters).

    After each forward, ``self.routing`` holds the :class:`~moa.routing.HeadRouting` of the queries.
    Attention weights, when asked for, are averaged over each token's active heads (batch, tgt_len,
    src_len), or every head's (num_heads, batch, tgt_len, src_len) with ``need_head_weights``
    (computed for all heads).
    """

    time_dim = 2  # cached keys/values: (batch, heads, len, D), as fairseq's MultiheadAttention

    def __init__(self, embed_dim: int, num_heads: int, shared_heads: int, top_k: int, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, dropout: float = 0.0, bias: bool = True, self_attention: bool = False,
                 encoder_decoder_attention: bool = False, gate_scale: str = "softmax", balance_loss: str = "paper",
                 router: str = "learned"):
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        super().__init__(embed_dim, embed_dim // num_heads, dropout, self_attention, encoder_decoder_attention)
        self.num_heads = num_heads
        self.shared_heads, self.top_k = shared_heads, top_k
        if router not in HEAD_ROUTERS:
            raise ValueError(f"router must be one of {HEAD_ROUTERS}, got {router!r}")
        self.router = QueryNormHeadRouter(num_heads, shared_heads, top_k) if router == "query-norm" else \
            TwoStageHeadRouter(embed_dim, num_heads, shared_heads, top_k, gate_scale, balance_loss)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        gain = 2 ** -0.5 if (kdim or embed_dim) == embed_dim == (vdim or embed_dim) else 1.0  # as fairseq's MHA
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if bias:
            nn.init.constant_(self.out_proj.bias, 0.0)

    path: Optional[str] = None  # None: by the rule of mix; "all-heads" or "packed" pins one (the tests compare them)

    @property
    def computed_heads(self) -> int:
        """The heads whose keys and values are projected: all of them, or the shared heads only when
        K = 0 (the routed heads are then never active)."""
        return self.num_heads if self.top_k else self.shared_heads

    def route(self, x: Tensor, padding: Optional[Tensor], aux: bool = True) -> Tuple[HeadRouting, Optional[Tensor]]:
        """The query-norm router scores the routed heads by their queries: every head's query is
        projected here, once, and reused for attention (returned as (N, h * D))."""
        if self.training and not self.top_k and self.router.routed_heads:
            raise ValueError(f"MoH with top_k 0 computes its {self.shared_heads} shared heads only, which is an "
                             f"inference setting (fairseq-generate --model-overrides \"{{'moh_top_k': 0}}\"); "
                             f"train with --moh-top-k between 1 and the {self.router.routed_heads} routed heads")
        queries = routed = None
        if self.router.needs_routed_queries and self.top_k:
            queries = self.q_proj(x)
            routed = queries[:, self.shared_heads * self.head_dim:].view(x.size(0), -1, self.head_dim)
        return self.router(x, padding, routed, aux), queries

    def mix(self, x, routing: HeadRouting, queries, keys, values, bias, tgt_len, bsz, need_weights,
            need_head_weights, decoding):
        """The module's output by one of two paths, which agree, chosen by arithmetic: ``packed``
        (:meth:`_mix_active_heads`: only the active (token, head) pairs' work, the method's point) for
        whole sequences, in training and without autograd alike; ``all-heads`` (:meth:`_mix_all_heads`)
        when every routed head or none is active, when every head's weights are asked for, and for
        incremental decoding, where each (sentence, head) group of the packed layout holds one query
        (a beam's with beam-folded cross-attention), so packing would skip no attention and save only
        the unselected heads' query and output rows, against its gathers. ``self.path`` pins one."""
        args = (x, routing, keys, values, bias, tgt_len, bsz, need_weights)
        if need_head_weights or self.top_k in (0, self.router.routed_heads) or self.path == "all-heads" or \
                (self.path is None and decoding):
            return self._mix_all_heads(*args, need_head_weights, queries)
        return self._mix_active_heads(*args, queries)

    def _mix_active_heads(self, x, routing: HeadRouting, keys, values, bias, tgt_len, bsz, need_weights,
                          queries: Optional[Tensor] = None):
        """Shared heads as multi-head attention; routed heads packed per (batch row, head).
        queries: (N, h * D), every head's query when the router computed them."""
        h_s, d = self.shared_heads, self.head_dim
        y = weight_sum = None
        if h_s:
            if queries is None:
                q = F.linear(x, self.q_proj.weight[:h_s * d], _rows(self.q_proj.bias, h_s * d))
            else:
                q = queries[:, :h_s * d]
            q = q.reshape(tgt_len, bsz, h_s, d).permute(1, 2, 0, 3)
            o, weights = self.attention_core(q, keys[:, :h_s], values[:, :h_s], bias, need_weights)
            o = o * routing.shared_gates.view(tgt_len, bsz, h_s).permute(1, 2, 0).unsqueeze(-1)
            y = F.linear(o.permute(2, 0, 1, 3).reshape(-1, h_s * d), self.out_proj.weight[:, :h_s * d],
                         self.out_proj.bias)
            if need_weights:
                weight_sum = weights.sum(dim=1)  # (B, T, S)
        if self.top_k:
            e = self.router.routed_heads
            plan = HeadPacking(routing.selected, e, tgt_len, bsz)
            if queries is None:
                q_weight = self.q_proj.weight[h_s * d:].view(e, d, -1).transpose(1, 2)  # (E, C, D), a view
                q_bias = None if self.q_proj.bias is None else self.q_proj.bias[h_s * d:].view(e, d)
                q = expert_linear(x, q_weight, q_bias, plan.token, plan.packed_row, plan.counts,
                                  plan.num_packed_rows, experts=plan.expert)
            else:
                selected = queries.view(x.size(0), self.num_heads, d)[plan.token,
                                                                     h_s + routing.selected.reshape(-1)[plan.order]]
                q = selected.new_zeros(plan.num_packed_rows, d).index_copy(0, plan.packed_row, selected)
            q = q.view(bsz, e, plan.length, d)
            o, weights = self.attention_core(q, keys[:, h_s:], values[:, h_s:],
                                             _packed_bias(bias, plan.position), need_weights)
            o_weight = self.out_proj.weight[:, h_s * d:].view(-1, e, d).permute(1, 2, 0)  # (E, D, C), a view
            gates = routing.gates.reshape(-1)[plan.order]
            routed = expert_linear(o.reshape(-1, d), o_weight, None, plan.packed_row, plan.token, plan.counts,
                                   x.size(0), scale=gates, experts=plan.expert)
            if y is None:  # no shared heads
                y = routed if self.out_proj.bias is None else routed + self.out_proj.bias
            else:
                y.add_(routed)  # in place: no second (N, C) result
            if need_weights:
                packed = weights.reshape(plan.num_packed_rows, -1)
                per_token = packed.new_zeros(bsz * tgt_len, packed.size(-1))
                per_token.index_add_(0, plan.batch_time_row, packed[plan.packed_row])
                per_token = per_token.view(bsz, tgt_len, -1)
                weight_sum = per_token if weight_sum is None else weight_sum + per_token
        weights = weight_sum / (h_s + self.top_k) if need_weights else None
        return y, weights

    def _mix_all_heads(self, x, routing: HeadRouting, keys, values, bias, tgt_len, bsz, need_weights,
                       need_head_weights, queries: Optional[Tensor] = None):
        """Every computed head (:attr:`computed_heads`), then scaled by its gate (zero for unselected
        routed heads). queries: (N, h * D), every head's query when the router computed them."""
        heads, width = self.computed_heads, self.computed_heads * self.head_dim
        gates = self.full_gates(routing)[:, :heads]  # (N, heads)
        if queries is None:
            queries = F.linear(x, self.q_proj.weight[:width], _rows(self.q_proj.bias, width))
        q = queries.view(tgt_len, bsz, heads, self.head_dim).permute(1, 2, 0, 3)
        o, weights = self.attention_core(q, keys, values, bias, need_weights)
        o = o * gates.view(tgt_len, bsz, heads).permute(1, 2, 0).unsqueeze(-1)
        y = F.linear(o.permute(2, 0, 1, 3).reshape(-1, width), self.out_proj.weight[:, :width], self.out_proj.bias)
        if not need_weights:
            return y, None
        if need_head_weights:
            return y, weights.transpose(0, 1)
        active = gates.ne(0).to(weights.dtype).view(tgt_len, bsz, heads).permute(1, 2, 0).unsqueeze(-1)
        return y, (weights * active).sum(dim=1) / (self.shared_heads + self.top_k)

    def full_gates(self, routing: HeadRouting) -> Tensor:
        """(N, num_heads) gate of every head, zero for the routed heads a token did not select."""
        known = routing.shared_gates if routing.shared_gates is not None else routing.gates
        gates = [] if routing.shared_gates is None else [routing.shared_gates]
        if self.router.routed_heads:
            routed = known.new_zeros(known.size(0), self.router.routed_heads)
            if routing.selected is not None:
                routed = routed.scatter(1, routing.selected, routing.gates)
            gates.append(routed)
        return torch.cat(gates, dim=1)

    def head_outputs(self, query, key, key_padding_mask=None, attn_mask=None):
        """Every head's attention and ``A_i V_i W_O^i``, ungated (see the base)."""
        return multihead_outputs(self, query, key, key_padding_mask, attn_mask)

    def active_heads(self):
        return "MoH", self.shared_heads + self.top_k, self.num_heads

    def _project_key_value(self, key: Tensor, value: Tensor):
        """The computed heads' keys and values: (src_len, batch, dim) -> (batch, heads, src_len, D) each."""
        src_len, bsz = key.shape[:2]
        heads = self.computed_heads
        width = heads * self.head_dim

        def project(proj: nn.Linear, t: Tensor) -> Tensor:
            t = proj(t) if heads == self.num_heads else F.linear(t, proj.weight[:width], _rows(proj.bias, width))
            return t.view(src_len, bsz, heads, self.head_dim).permute(1, 2, 0, 3)

        return project(self.k_proj, key), project(self.v_proj, value)

    def extra_repr(self) -> str:
        router = "query-norm" if isinstance(self.router, QueryNormHeadRouter) else \
            f"learned, gate_scale={self.router.gate_scale}"
        return (f"heads={self.num_heads} (shared {self.shared_heads}, top-{self.top_k} of "
                f"{self.router.routed_heads} routed), head_dim={self.head_dim}, router={router}, "
                f"self_attention={self.self_attention}, encoder_decoder_attention={self.encoder_decoder_attention}")


def multihead_outputs(module, query: Tensor, key: Tensor, key_padding_mask: Optional[Tensor] = None,
                      attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(A, O) of :meth:`RoutedAttention.head_outputs` for a module with fairseq's ``MultiheadAttention``
    parameters (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``num_heads``, ``head_dim``): MoH's,
    and fairseq's own. query: (T, B, C); key: (S, B, C_k)."""
    heads, d = module.num_heads, module.head_dim

    def split(t: Tensor) -> Tensor:  # (len, B, H * D) -> (B, H, len, D)
        return t.view(t.size(0), t.size(1), heads, d).permute(1, 2, 0, 3)

    q, k, v = split(module.q_proj(query)), split(module.k_proj(key)), split(module.v_proj(key))
    attention = attention_probs(q, k, attention_bias(attn_mask, key_padding_mask, q.dtype), d ** -0.5)
    w_o = module.out_proj.weight.view(-1, heads, d).permute(1, 2, 0)  # (H, D, C)
    return attention, torch.matmul(torch.matmul(attention, v), w_o[None])


def _rows(bias: Optional[Tensor], n: int) -> Optional[Tensor]:
    return None if bias is None else bias[:n]


def _packed_bias(bias: Optional[Tensor], position: Tensor) -> Optional[Tensor]:
    """The additive mask of the packed routed queries. bias: (1 or B, 1, T or 1, S) from
    :func:`attention_bias`; position: (B, E, L) time step of each packed query. A per-query mask
    (causal) becomes each packed query's row, (B, E, L, S); key padding alone is the same for
    every row and stays as it is."""
    if bias is None or bias.size(2) == 1:
        return bias
    rows = bias[:, 0]  # (1 or B, T, S)
    batch = torch.arange(position.size(0), device=position.device).view(-1, 1, 1) if rows.size(0) > 1 else 0
    return rows[batch, position]
