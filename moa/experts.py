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
backward gathers again. No host synchronisation happens inside it: the block
sizes are Python ints computed once per module.
"""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn


# The most elements a chunk's gathered rows may hold (1 MiB in float32): a large projection is done a few
# experts at a time, so that its temporaries stay in the CPU's caches and in memory the allocator reuses;
# one (M, in_dim) gather of every assignment at once costs a fresh buffer, which on CPU is mapped and
# faulted in page by page on every call (python -m benchmarks.lm_decoding --sections module).
CHUNK_ELEMENTS = 1 << 18


def expert_chunks(group_sizes: List[int], width: int) -> List[Tuple[int, int, int, int]]:
    """Consecutive runs of whole experts, ``(first_expert, end_expert, first_row, end_row)``, each
    holding at most ``CHUNK_ELEMENTS // width`` rows (or a single expert that has more)."""
    limit = max(1, CHUNK_ELEMENTS // max(width, 1))
    chunks, first, row, start = [], 0, 0, 0
    for e, size in enumerate(group_sizes):
        if size and row > start and row + size - start > limit:
            chunks.append((first, e, start, row))
            first, start = e, row
        row += size
    chunks.append((first, len(group_sizes), start, row))
    return chunks


def _workspace(like: Tensor, chunks, *widths: int) -> List[Tensor]:
    """One (rows, width) buffer per width, for the largest chunk: every chunk of a pass reuses them, so
    the pass touches fresh memory once, not once per chunk."""
    rows = max(hi - lo for _, _, lo, hi in chunks)
    return [like.new_empty(rows, width) for width in widths]


class _ExpertLinear(torch.autograd.Function):
    """out[dst[p]] += scale[p] * x[src[p]] @ W[e] (+ b[e]) for each expert e's block of assignments p.

    The experts go in chunks (:func:`expert_chunks`): each chunk gathers its rows at once (one
    ``index_select``), multiplies expert by expert into the blocks of one result (``mm(out=)``, no
    per-expert copies) and writes back with one ``index_copy_``/``index_add_``: three memory passes in
    all, whatever E is, and E matmuls (two per expert in the backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, src, dst, group_sizes, out_rows, dst_is_permutation, expert_dim):
        experts = weight.unbind(expert_dim)
        out_dim = weight.size(-1)
        # Every row written exactly once needs no zero fill: copy instead of accumulating.
        out = x.new_empty(out_rows, out_dim) if dst_is_permutation else x.new_zeros(out_rows, out_dim)
        chunks = expert_chunks(group_sizes, max(x.size(1), out_dim))
        rows_space, y_space = _workspace(x, chunks, x.size(1), out_dim)
        for first, end, lo, hi in chunks:
            rows = torch.index_select(x, 0, src[lo:hi], out=rows_space[:hi - lo])  # sorted by expert
            if scale is not None:
                rows.mul_(scale[lo:hi].unsqueeze(1))
            y = y_space[:hi - lo]
            sizes = group_sizes[first:end]
            for e, r, block in zip(range(first, end), rows.split(sizes), y.split(sizes)):
                if r.numel():
                    torch.mm(r, experts[e], out=block)
                    if bias is not None:
                        block += bias[e]
            (out.index_copy_ if dst_is_permutation else out.index_add_)(0, dst[lo:hi], y)
        ctx.save_for_backward(x, weight, scale, src, dst)
        ctx.group_sizes, ctx.chunks = group_sizes, chunks
        ctx.has_bias = bias is not None
        ctx.expert_dim = expert_dim
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, scale, src, dst = ctx.saved_tensors
        group_sizes = ctx.group_sizes
        need_x, need_w, need_b, need_scale = ctx.needs_input_grad[:4]
        experts = weight.unbind(ctx.expert_dim)
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_experts = grad_w.unbind(ctx.expert_dim) if need_w else None
        grad_b = [] if need_b and ctx.has_bias else None
        grad_scale = scale.new_empty(scale.shape) if need_scale else None
        chunks = ctx.chunks  # the forward's: grad_out has its output's width
        need_rows, need_g_rows = need_w or need_scale, need_x or need_scale  # a buffer not needed: width 0
        (g_space,) = _workspace(grad_out, chunks, grad_out.size(1))
        rows_space, g_rows_space = _workspace(x, chunks, x.size(1) * need_rows, x.size(1) * need_g_rows)
        for first, end, lo, hi in chunks:
            sizes = group_sizes[first:end]
            g = torch.index_select(grad_out, 0, dst[lo:hi], out=g_space[:hi - lo])  # sorted by expert
            g_blocks = g.split(sizes)
            # the unscaled gathered rows
            rows = torch.index_select(x, 0, src[lo:hi], out=rows_space[:hi - lo]) if need_rows else None
            if need_g_rows:
                g_rows = g_rows_space[:hi - lo]  # gradient w.r.t. the (scaled) gathered rows
                for e, gb, block in zip(range(first, end), g_blocks, g_rows.split(sizes)):
                    if gb.numel():
                        torch.mm(gb, experts[e].t(), out=block)
                if need_scale:
                    grad_scale[lo:hi] = (g_rows * rows).sum(1)
                if need_x:
                    grad_x.index_add_(0, src[lo:hi], g_rows if scale is None else g_rows.mul_(scale[lo:hi].unsqueeze(1)))
            if need_w:
                if scale is not None:
                    rows.mul_(scale[lo:hi].unsqueeze(1))
                for e, r, gb in zip(range(first, end), rows.split(sizes), g_blocks):
                    if not gb.numel():
                        grad_experts[e].zero_()
                    elif grad_experts[e].is_contiguous():
                        torch.mm(r.t(), gb, out=grad_experts[e])
                    elif grad_experts[e].t().is_contiguous():  # a transposed view, as of nn.Linear's (out, in) weight
                        torch.mm(gb.t(), r, out=grad_experts[e].t())
                    else:  # a strided (in_dim, out_dim) slice of the (in_dim, E, out_dim) layout
                        grad_experts[e].copy_(r.t() @ gb)
            if grad_b is not None:
                grad_b += [gb.sum(0) for gb in g_blocks]
        if grad_b is not None:
            grad_b = torch.stack(grad_b)
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
