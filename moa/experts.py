"""Expert projections that only see the rows routed to them.

MoA gives every expert i its own query projection W_q^i (d_model -> D) and
output projection W_o^i (D -> d_model). With N tokens each routed to k experts
there are N*k (token, slot) assignments. A dispatch plan (:mod:`moa.dispatch`)
sorts them by expert once per module; :func:`expert_linear` then multiplies each
expert's block of rows by that expert's weight only: N*k rows of work in all,
never N*E.

:func:`expert_linear` gathers its input rows, multiplies and scatter-adds the
results in one autograd node (in the manner of ScatterMoE), so the gathered
(N*k, in_dim) copy of the input is never kept for the backward pass; the
backward gathers again, block by block. No host synchronisation happens
inside it: the block sizes are Python ints computed once per module.
"""

import math
from typing import List, Optional

import torch
from torch import Tensor, nn


class _ExpertLinear(torch.autograd.Function):
    """out[dst[p]] += scale[p] * x[src[p]] @ W[e] (+ b[e]) for each expert e's block of assignments p."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, src, dst, group_sizes, out_rows, dst_is_permutation, expert_dim):
        experts = weight.unbind(expert_dim)
        # Every row written exactly once needs no zero fill: copy instead of accumulating.
        out = (x.new_empty if dst_is_permutation else x.new_zeros)(out_rows, weight.size(-1))
        write = out.index_copy_ if dst_is_permutation else out.index_add_
        scales = scale.split(group_sizes) if scale is not None else [None] * len(group_sizes)
        for e, (s, d, c) in enumerate(zip(src.split(group_sizes), dst.split(group_sizes), scales)):
            if s.numel():
                rows = x.index_select(0, s)
                if c is not None:
                    rows *= c.unsqueeze(1)
                y = rows @ experts[e]
                if bias is not None:
                    y += bias[e]
                write(0, d, y)
        ctx.save_for_backward(x, weight, scale, src, dst)
        ctx.group_sizes = group_sizes
        ctx.has_bias = bias is not None
        ctx.expert_dim = expert_dim
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, scale, src, dst = ctx.saved_tensors
        need_x, need_w, need_b, need_scale = ctx.needs_input_grad[:4]
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = weight.new_zeros(weight.size(ctx.expert_dim), weight.size(-1)) if need_b and ctx.has_bias else None
        grad_scale = torch.empty_like(scale) if need_scale else None
        experts = weight.unbind(ctx.expert_dim)
        grad_experts = grad_w.unbind(ctx.expert_dim) if grad_w is not None else None
        offset = 0
        for e, (s, d) in enumerate(zip(src.split(ctx.group_sizes), dst.split(ctx.group_sizes))):
            n = s.numel()
            if not n:
                if grad_w is not None:
                    grad_experts[e].zero_()
                continue
            g = grad_out.index_select(0, d)
            c = scale[offset:offset + n].unsqueeze(1) if scale is not None else None
            rows = x.index_select(0, s) if grad_w is not None or grad_scale is not None else None
            if grad_x is not None or grad_scale is not None:
                g_rows = g @ experts[e].t()  # gradient w.r.t. the (scaled) gathered rows
                if grad_scale is not None:
                    grad_scale[offset:offset + n] = (g_rows * rows).sum(1)
                if grad_x is not None:
                    grad_x.index_add_(0, s, g_rows if c is None else g_rows * c)
            if grad_w is not None:
                if c is not None:
                    rows *= c
                if grad_experts[e].is_contiguous():
                    torch.mm(rows.t(), g, out=grad_experts[e])
                elif grad_experts[e].t().is_contiguous():  # a transposed view, as of nn.Linear's (out, in) weight
                    torch.mm(g.t(), rows, out=grad_experts[e].t())
                else:  # a strided (in_dim, out_dim) slice of the (in_dim, E, out_dim) layout
                    grad_experts[e].copy_(rows.t() @ g)
            if grad_b is not None:
                grad_b[e] = g.sum(0)
            offset += n
        return grad_x, grad_w, grad_b, grad_scale, None, None, None, None, None, None


def expert_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], src: Tensor, dst: Tensor,
                  group_sizes: List[int], out_rows: int, scale: Optional[Tensor] = None,
                  dst_is_permutation: bool = False, expert_dim: int = 0) -> Tensor:
    """Grouped expert projection with gather, row scaling and scatter-add built in.

    x: (rows_in, in_dim); weight: (E, in_dim, out_dim), or (in_dim, E, out_dim) with
    ``expert_dim=1``; bias: (E, out_dim) or None;
    src, dst: (M,) row indices, sorted by expert in blocks of ``group_sizes``;
    scale: (M,) per-assignment factor on the gathered row (MoA's gate weight), or None.
    Returns (out_rows, out_dim) with
    ``out[dst[p]] = sum of (scale[p] * x[src[p]]) @ weight[e(p)] (+ bias[e(p)])``.
    Rows of dst that no assignment names stay zero and repeated dst rows are summed
    (on CUDA in a nondeterministic order, as index_add_ is there), unless
    ``dst_is_permutation`` promises that dst names each of the out_rows exactly once.
    Under autocast the projection runs in the autocast dtype, as ``F.linear`` would.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):  # an autograd Function is not autocast: cast as a matmul would be
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        scale = None if scale is None else scale.to(dtype)
    return _ExpertLinear.apply(x, weight, bias, scale, src, dst, group_sizes, out_rows, dst_is_permutation,
                               expert_dim)


class ExpertLinear(nn.Module):
    """E independent linear maps ``in_dim -> out_dim``.

    weight: (E, in_dim, out_dim) with ``expert_dim=0``, or (in_dim, E, out_dim) with
    ``expert_dim=1``: the layout in which :meth:`fan_out` (all experts at once) is a
    free view, used for MoA's query experts. bias: (E, out_dim) or None. Each expert
    is initialised like an ``nn.Linear(in_dim, out_dim)`` with Xavier-uniform.
    """

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, bias: bool = False, expert_dim: int = 0):
        super().__init__()
        if expert_dim not in (0, 1):
            raise ValueError("expert_dim must be 0 or 1")
        self.num_experts, self.in_dim, self.out_dim, self.expert_dim = num_experts, in_dim, out_dim, expert_dim
        shape = (num_experts, in_dim, out_dim) if expert_dim == 0 else (in_dim, num_experts, out_dim)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(num_experts, out_dim)) if bias else None
        bound = math.sqrt(6.0 / (in_dim + out_dim))
        nn.init.uniform_(self.weight, -bound, bound)

    def expert_weight(self, e: int) -> Tensor:
        """Expert e's (in_dim, out_dim) matrix (a view)."""
        return self.weight[e] if self.expert_dim == 0 else self.weight[:, e]

    def forward(self, x: Tensor, src: Tensor, dst: Tensor, group_sizes: List[int], out_rows: int,
                scale: Optional[Tensor] = None, dst_is_permutation: bool = False, add_bias: bool = True) -> Tensor:
        """Routed rows only; see :func:`expert_linear`. ``add_bias=False`` leaves the bias to the caller."""
        return expert_linear(x, self.weight, self.bias if add_bias else None, src, dst, group_sizes, out_rows,
                             scale, dst_is_permutation, self.expert_dim)

    def fan_out(self, x: Tensor) -> Tensor:
        """Every row through every expert, for top_k == E: (N, in_dim) -> (N, E, out_dim), one matmul.
        Needs ``expert_dim=1``."""
        if self.expert_dim != 1:
            raise RuntimeError("fan_out needs the (in_dim, E, out_dim) layout, expert_dim=1")
        flat = self.weight.view(self.in_dim, -1)
        y = x @ flat if self.bias is None else torch.addmm(self.bias.reshape(-1), x, flat)
        return y.view(x.size(0), self.num_experts, self.out_dim)

    def fan_in(self, h: Tensor) -> Tensor:
        """Sum of every expert's projection, for top_k == E: (N, E, in_dim) -> (N, out_dim), one
        matmul; the bias is the caller's (it is gated). Needs ``expert_dim=0``."""
        if self.expert_dim != 0:
            raise RuntimeError("fan_in needs the (E, in_dim, out_dim) layout, expert_dim=0")
        return h.reshape(h.size(0), -1) @ self.weight.view(-1, self.out_dim)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_dim={self.in_dim}, out_dim={self.out_dim}, "
                f"bias={self.bias is not None}, expert_dim={self.expert_dim}")
