"""A float64 reference of the released SwitchHead layer (RobertCsordas/switchhead, ``SwitchHeadCore`` with
plain scaled dot-product attention: ``SwitchHeadRope(..., rotate_fraction=0.0)``), written from what its
code computes, for the equality tests of :mod:`moa.switchhead_attention`.

Same parameters, names and shapes as the released core: ``q``, ``k`` (nn.Linear, no bias, H*D x d),
``v`` (H*E, d, D), ``o`` (H*E, D, d), ``sel_v``, ``sel_o`` (H*E, d); with E = 1, ``v`` (H*D, d) and ``o``
(d, H*D). Batch-first inputs, masks True where blocked (``position_mask`` (T, S), ``src_length_mask``
(B, S)), as its ``AttentionMask``. Its ``cvmm`` (a CUDA Triton kernel) is replaced by what it computes:
each token's row times each selected expert's matrix, weighted by the selection and summed over the k
(values) or the H x k (outputs) selections. One departure: the released layer casts the selection
logits to float32; here they stay in the inputs' dtype, so that float64 compares to 1e-10 (float32
selection would bound any comparison at float32's rounding).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ReleasedSwitchHead(nn.Module):
    def __init__(self, d_model, n_heads, n_experts, d_head, moe_k):
        super().__init__()
        self.h, self.e, self.d, self.top_k = n_heads, n_experts, d_head, moe_k
        self.q = nn.Linear(d_model, n_heads * d_head, bias=False)
        self.k = nn.Linear(d_model, n_heads * d_head, bias=False)
        if n_experts > 1:
            self.v = nn.Parameter(torch.randn(n_heads * n_experts, d_model, d_head) / math.sqrt(d_model))
            self.o = nn.Parameter(torch.randn(n_heads * n_experts, d_head, d_model) / math.sqrt(n_heads * d_head))
            self.sel_v = nn.Parameter(torch.randn(n_heads * n_experts, d_model) / math.sqrt(d_model))
        else:
            self.v = nn.Parameter(torch.randn(n_heads * d_head, d_model) / math.sqrt(d_model))
            self.o = nn.Parameter(torch.randn(d_model, n_heads * d_head) / math.sqrt(n_heads * d_head))
        self.sel_o = nn.Parameter(torch.randn(n_heads * n_experts, d_model) / math.sqrt(d_model))
        # the released scale: 1/sqrt(D) held in float32, its square root applied to q and to k
        self.register_buffer("scale", torch.full([1], 1.0 / math.sqrt(d_head)), persistent=False)

    def select(self, t, w):
        """(experts numbered h*E + e, their sigmoid scores), each (B, T, H, k)."""
        scores = F.linear(t, w).view(*t.shape[:-1], self.h, self.e).sigmoid()
        index = scores.detach().topk(self.top_k, dim=-1, sorted=False).indices
        return index + torch.arange(self.h).view(-1, 1) * self.e, scores.gather(-1, index)

    def forward(self, q_src, k_src, v_src, position_mask=None, src_length_mask=None):
        b, t, _ = q_src.shape
        s = k_src.shape[1]
        root = self.scale.sqrt()
        q = (self.q(q_src) * root).view(b, t, self.h, self.d).transpose(1, 2)
        k = (self.k(k_src) * root).view(b, s, self.h, self.d).transpose(1, 2)
        if self.e > 1:
            v_index, v_weight = self.select(k_src, self.sel_v)
            # values: sum_j w_j x_s V[index_j], (B, S, H, D)
            v = torch.einsum("bsd,bshjdf,bshj->bshf", v_src, self.v[v_index], v_weight).transpose(1, 2)
        else:
            v = F.linear(v_src, self.v).view(b, s, self.h, self.d).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        if position_mask is not None:
            scores = scores.masked_fill(position_mask, float("-inf"))
        if src_length_mask is not None:
            scores = scores.masked_fill(src_length_mask[:, None, None, :], float("-inf"))
        res = (scores.softmax(-1) @ v).transpose(1, 2)  # (B, T, H, D)
        if self.e > 1:
            o_index, o_weight = self.select(q_src, self.sel_o)
            return torch.einsum("bthd,bthjdf,bthj->btf", res, self.o[o_index], o_weight)
        gate = F.linear(q_src, self.sel_o).sigmoid()
        return F.linear((res * gate[..., None]).flatten(-2), self.o)
