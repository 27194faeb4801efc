"""A re-creation, for timing only, of how the authors' released MoA layer computes.

Written from a description of its algorithm, not from its code: route with a
float softmax and top-k (raw probabilities as gates); gather the routed rows;
run one matmul per expert in a Python loop whose block sizes are read back with
``.tolist()`` in the forward AND again in the backward (a host sync per call);
``torch.cat`` the pieces; ``index_add`` them into a zero (N*k, D) buffer;
attention with materialised scores via einsum; then the same gather/loop/
index_add for the output projections. Outputs match ``MixtureOfAttentionHeads``
with ``gate_weights="raw"``; it is here so that benchmarks time both designs
side by side in one run.
"""

import torch
from torch import nn


class _LoopedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sizes, weight):
        pieces = [chunk @ weight[e] for e, chunk in enumerate(rows.split(sizes.tolist()))]
        ctx.save_for_backward(rows, sizes, weight)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        rows, sizes, weight = ctx.saved_tensors
        split = sizes.tolist()
        grads = grad.split(split)
        d_rows = torch.cat([torch.einsum("bi,ji->bj", g, weight[e]) for e, g in enumerate(grads)])
        d_weight = torch.stack([torch.einsum("bi,bj->ij", r, g) for r, g in zip(rows.split(split), grads)])
        return d_rows, None, d_weight


class AuthorsStyleMoA(nn.Module):
    """Self-attention only; shares its parameters with a ``MixtureOfAttentionHeads``."""

    def __init__(self, moa_module):
        super().__init__()
        self.m = moa_module

    def forward(self, x):  # x: (T, B, C)
        m = self.m
        tgt_len, bsz, dim = x.shape
        flat = x.transpose(0, 1).reshape(-1, dim)  # (B*T, C)
        probs = torch.softmax(flat @ m.router.weight.t(), dim=-1)
        gates, experts = probs.topk(m.top_k, dim=-1)
        order = experts.flatten().sort(0).indices
        token = order // m.top_k
        sizes = torch.bincount(experts.flatten(), minlength=m.num_experts)
        q = _LoopedExperts.apply(flat[token], sizes, m.q_experts.weight.transpose(0, 1))
        q = torch.zeros(flat.size(0) * m.top_k, m.head_dim, dtype=x.dtype).index_add(0, order, q)
        q = q.view(bsz, tgt_len, m.top_k, m.head_dim) * m.scaling
        k = m.k_proj(x).transpose(0, 1)
        v = m.v_proj(x).transpose(0, 1)
        attn = torch.softmax(torch.einsum("bike,bje->bkij", q, k), dim=-1)
        o = torch.einsum("bkij,bje->bike", attn, v).reshape(-1, m.head_dim)
        y = _LoopedExperts.apply(o[order], sizes, m.o_experts.weight) * gates.flatten()[order, None]
        y = torch.zeros_like(flat).index_add(0, token, y)
        return y.view(bsz, tgt_len, dim).transpose(0, 1)
