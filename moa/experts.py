"""Expert projections that only see the rows routed to them.

MoA gives every expert i its own query projection W_q^i (d_model -> D) and
output projection W_o^i (D -> d_model). With N tokens each routed to k experts
there are N*k (token, slot) assignments. A dispatch plan (:mod:`moa.dispatch`)
sorts them by expert once per module; :func:`expert_linear` then multiplies each
expert's block of rows by that expert's weight only: N*k rows of work in all,
never N*E. It has two implementations of one contract, chosen by where it runs:

* ``loop`` (:class:`_ExpertLinear`, CPUs, and GPUs outside bfloat16): gathers its input rows,
  multiplies expert by expert and scatter-adds the results in one autograd node (in the manner of
  ScatterMoE), so the gathered (N*k, in_dim) copy of the input is never kept for the backward pass.
  The block sizes are Python ints: one host read of the plan's counts per module.
* ``grouped`` (:func:`_grouped_expert_linear`, CUDA in bfloat16, where torch's grouped GEMM has its
  fast kernel): every expert in one ``torch.nn.functional.grouped_mm`` over a layout whose groups are
  padded to the kernel's alignment, of a static size, with offsets computed on the device: no host
  read at all, as torchtitan's MoE does.
"""

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The most elements a chunk's gathered rows may hold (1 MiB in float32): a large projection is done a few
# experts at a time, so that its temporaries stay in the CPU's caches and in memory the allocator reuses;
# one (M, in_dim) gather of every assignment at once costs a fresh buffer, which on CPU is mapped and
# faulted in page by page on every call (python -m benchmarks.lm_decoding --sections module).
CHUNK_ELEMENTS = 1 << 18
# The rows each group of the grouped GEMM is padded to on CUDA (its bfloat16 kernel's alignment).
GROUPED_ALIGNMENT = 16
# None: choose by device and dtype (see expert_linear); "loop" or "grouped": always that implementation.
METHOD: Optional[str] = None


class GroupSizes:
    """The rows of each expert's block: ``counts`` (E,) int64 on the device, and ``as_list()``, the same
    as Python ints, read from the device once (by the loop implementation only)."""

    def __init__(self, counts: Tensor, as_list: Optional[List[int]] = None):
        self.counts = counts
        self._list = as_list

    def as_list(self) -> List[int]:
        if self._list is None:
            self._list = self.counts.tolist()  # the plan's one host read
        return self._list


def gemm_rows(size: int, x: Tensor) -> int:
    """The rows the loop computes for a block of ``size`` rows: ``size`` itself, except in bfloat16 and
    float16 on a CPU, where torch's matmul (oneDNN) compiles a kernel for every new shape, which costs
    about ten times the product itself: there a block is padded to a multiple of an eighth of the power
    of two below its size (at least 16 rows), at most 1/8 more rows, about eight shapes per octave, so that
    the kernels are compiled once and reused."""
    if not size or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return size
    step = 1 << max(4, size.bit_length() - 4)
    return -(-size // step) * step


def expert_chunks(group_sizes: Sequence[int], width: int) -> List[Tuple[int, int, int, int]]:
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


class _Chunk:
    """One chunk of the loop: experts ``first..end-1``, their assignments ``lo..hi-1`` (sorted order),
    and the ``rows`` the chunk's GEMMs compute, ``blocks`` per expert (:func:`gemm_rows`). Without
    padding ``src``/``dst`` are the slices of the plan's; with padding they hold a row per computed row
    (``dst_write`` sends the padding rows' results to the scratch row ``out_rows``, ``dst`` reads row 0
    for them), ``pads`` are the padding rows, zeroed, and ``real`` the computed row of each assignment."""

    def __init__(self, first, end, lo, hi, blocks, src, dst, out_rows, sizes):
        self.first, self.end, self.lo, self.hi, self.blocks = first, end, lo, hi, blocks
        self.rows = sum(blocks)
        self.pads = self.real = None
        if self.rows == hi - lo:
            self.src, self.dst = src[lo:hi], dst[lo:hi]
            self.dst_write = self.dst
            return
        shift = [block_start - real_start for block_start, real_start in
                 zip(_starts(blocks), _starts(sizes[first:end]))]
        self.real = torch.arange(hi - lo, device=src.device) + torch.repeat_interleave(
            torch.tensor(shift, device=src.device), torch.tensor(sizes[first:end], device=src.device))
        self.src = src.new_zeros(self.rows).index_copy_(0, self.real, src[lo:hi])
        self.dst = dst.new_zeros(self.rows).index_copy_(0, self.real, dst[lo:hi])
        self.dst_write = dst.new_full((self.rows,), out_rows).index_copy_(0, self.real, dst[lo:hi])
        padding = torch.ones(self.rows, dtype=torch.bool, device=src.device)
        self.pads = padding.index_fill_(0, self.real, False).nonzero().squeeze(1)

    def padded(self, values: Tensor) -> Tensor:
        """This chunk's slice of per-assignment ``values`` (M,), at its computed rows (zero at padding)."""
        part = values[self.lo:self.hi]
        return part if self.real is None else part.new_zeros(self.rows).index_copy_(0, self.real, part)

    def unpadded(self, values: Tensor) -> Tensor:
        return values if self.real is None else values.index_select(0, self.real)


def _starts(sizes):
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def _layout(x: Tensor, group_sizes: List[int], src: Tensor, dst: Tensor, out_rows: int, width: int) -> List[_Chunk]:
    blocks = [gemm_rows(size, x) for size in group_sizes]
    starts = _starts(group_sizes) + [sum(group_sizes)]
    return [_Chunk(first, end, starts[first], starts[end], blocks[first:end], src, dst, out_rows, group_sizes)
            for first, end, _, _ in expert_chunks(blocks, width)]


def _workspace(like: Tensor, chunks: List[_Chunk], *widths: int) -> List[Tensor]:
    """One (rows, width) buffer per width, for the largest chunk: every chunk of a pass reuses them, so
    the pass touches fresh memory once, not once per chunk."""
    rows = max(chunk.rows for chunk in chunks)
    return [like.new_empty(rows, width) for width in widths]


class _ExpertLinear(torch.autograd.Function):
    """out[dst[p]] += scale[p] * x[src[p]] @ W[e] (+ b[e]) for each expert e's block of assignments p.

    The experts go in chunks (:func:`expert_chunks`): each chunk gathers its rows at once (one
    ``index_select``), multiplies expert by expert into the blocks of one result (``mm(out=)``, no
    per-expert copies) and writes back with one ``index_copy_``/``index_add_``: three memory passes in
    all, whatever E is, and E matmuls (two per expert in the backward). Blocks padded by
    :func:`gemm_rows` carry zero rows, whose results go to a scratch row of the output."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, src, dst, group_sizes, out_rows, dst_is_permutation, expert_dim):
        experts = weight.unbind(expert_dim)
        out_dim = weight.size(-1)
        chunks = _layout(x, group_sizes, src, dst, out_rows, max(x.size(1), out_dim))
        scratch = int(any(chunk.pads is not None for chunk in chunks))  # a row for the padding rows' results
        # Every row written exactly once needs no zero fill: copy instead of accumulating.
        out = x.new_empty(out_rows + scratch, out_dim) if dst_is_permutation else x.new_zeros(out_rows + scratch, out_dim)
        rows_space, y_space = _workspace(x, chunks, x.size(1), out_dim)
        for chunk in chunks:
            rows = torch.index_select(x, 0, chunk.src, out=rows_space[:chunk.rows])  # sorted by expert
            if scale is not None:
                rows.mul_(chunk.padded(scale).unsqueeze(1))  # zero at the padding rows
            elif chunk.pads is not None:
                rows.index_fill_(0, chunk.pads, 0)
            y = y_space[:chunk.rows]
            for e, r, block in zip(range(chunk.first, chunk.end), rows.split(chunk.blocks), y.split(chunk.blocks)):
                if r.numel():
                    torch.mm(r, experts[e], out=block)
                    if bias is not None:
                        block += bias[e]
            (out.index_copy_ if dst_is_permutation else out.index_add_)(0, chunk.dst_write, y)
        ctx.save_for_backward(x, weight, scale)
        ctx.chunks, ctx.has_bias, ctx.expert_dim = chunks, bias is not None, expert_dim
        return out[:out_rows] if scratch else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, scale = ctx.saved_tensors
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
        for chunk in chunks:
            g = torch.index_select(grad_out, 0, chunk.dst, out=g_space[:chunk.rows])  # sorted by expert
            if chunk.pads is not None:
                g.index_fill_(0, chunk.pads, 0)
            g_blocks = g.split(chunk.blocks)
            scale_c = None if scale is None else chunk.padded(scale).unsqueeze(1)
            # the unscaled gathered rows
            rows = torch.index_select(x, 0, chunk.src, out=rows_space[:chunk.rows]) if need_rows else None
            if need_g_rows:
                g_rows = g_rows_space[:chunk.rows]  # gradient w.r.t. the (scaled) gathered rows
                for e, gb, block in zip(range(chunk.first, chunk.end), g_blocks, g_rows.split(chunk.blocks)):
                    if gb.numel():
                        torch.mm(gb, experts[e].t(), out=block)
                if need_scale:
                    grad_scale[chunk.lo:chunk.hi] = chunk.unpadded((g_rows * rows).sum(1))
                if need_x:  # the padding rows' g_rows are zero: they add nothing to row 0
                    grad_x.index_add_(0, chunk.src, g_rows if scale is None else g_rows.mul_(scale_c))
            if need_w:
                if scale is not None:
                    rows.mul_(scale_c)
                for e, r, gb in zip(range(chunk.first, chunk.end), rows.split(chunk.blocks), g_blocks):
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


def _grouped_expert_linear(x, weight, bias, src, dst, counts, experts, out_rows, scale, dst_is_permutation,
                           expert_dim, alignment=GROUPED_ALIGNMENT):
    """:func:`expert_linear` by torch's grouped GEMM, with no host read: each expert's rows are placed in
    a layout of static size ``M + E (alignment - 1)`` (M assignments), every group starting at a multiple
    of ``alignment`` and padded with zero rows, its offsets ``cumsum`` on the device in int32, as
    torchtitan does; autograd differentiates the gathers, the GEMM and the scatter.
    counts: (E,) rows per expert; experts: (M,) the expert of each sorted assignment."""
    num_experts, assignments = counts.numel(), src.numel()
    w = weight if expert_dim == 0 else weight.transpose(0, 1)  # (E, in_dim, out_dim)
    padded = (counts + alignment - 1) // alignment * alignment
    ends = padded.cumsum(0)
    first_row = (ends - padded) - (counts.cumsum(0) - counts)  # padded start minus sorted start, per expert
    rows = torch.arange(assignments, device=x.device) + first_row[experts]  # each assignment's padded row
    gathered = x.index_select(0, src)
    if scale is not None:
        gathered = gathered * scale.unsqueeze(1)
    layout = x.new_zeros(assignments + num_experts * (alignment - 1), x.size(1)).index_copy(0, rows, gathered)
    y = F.grouped_mm(layout, w, offs=ends.to(torch.int32)).index_select(0, rows)
    if bias is not None:
        y = y + bias[experts]
    out = x.new_zeros(out_rows, y.size(1))
    return out.index_copy(0, dst, y) if dst_is_permutation else out.index_add(0, dst, y)


def grouped_gemm_is_fast(x: Tensor, weight: Tensor) -> bool:
    """Whether torch's grouped GEMM runs its fused kernel here: CUDA (compute capability 8.0 or newer),
    bfloat16, inner and outer widths of whole 16-byte units. Elsewhere it loops over the groups itself,
    reading the offsets on the host."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.size(1) % 8 == 0
            and weight.size(-1) % 8 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 0))


def expert_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], src: Tensor, dst: Tensor,
                  group_sizes: Union[GroupSizes, List[int]], out_rows: int, scale: Optional[Tensor] = None,
                  dst_is_permutation: bool = False, expert_dim: int = 0, experts: Optional[Tensor] = None,
                  method: Optional[str] = None) -> Tensor:
    """Grouped expert projection with gather, row scaling and scatter-add built in.

    x: (rows_in, in_dim); weight: (E, in_dim, out_dim), or (in_dim, E, out_dim) with
    ``expert_dim=1``; bias: (E, out_dim) or None;
    src, dst: (M,) row indices, sorted by expert in blocks of ``group_sizes`` (a :class:`GroupSizes`, or
    a list of ints); scale: (M,) per-assignment factor on the gathered row (MoA's gate weight), or None;
    experts: (M,) the expert of each assignment (the grouped implementation's; derived from the sizes
    when not given).
    Returns (out_rows, out_dim) with
    ``out[dst[p]] = sum of (scale[p] * x[src[p]]) @ weight[e(p)] (+ bias[e(p)])``.
    Rows of dst that no assignment names stay zero and repeated dst rows are summed
    (on CUDA in a nondeterministic order, as index_add_ is there), unless
    ``dst_is_permutation`` promises that dst names each of the out_rows exactly once.
    ``method``: "loop" or "grouped" (see the module); by default (and :data:`METHOD` None) grouped
    where :func:`grouped_gemm_is_fast`, else the loop.
    Under autocast the projection runs in the autocast dtype, as ``F.linear`` would.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):  # an autograd Function is not autocast: cast as a matmul would be
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        scale = None if scale is None else scale.to(dtype)
    sizes = group_sizes if isinstance(group_sizes, GroupSizes) else \
        GroupSizes(torch.tensor(group_sizes, device=x.device), list(group_sizes))
    method = method or METHOD or ("grouped" if grouped_gemm_is_fast(x, weight) else "loop")
    if method == "grouped":
        if experts is None:
            experts = torch.repeat_interleave(torch.arange(sizes.counts.numel(), device=x.device), sizes.counts,
                                              output_size=src.numel())
        return _grouped_expert_linear(x, weight, bias, src, dst, sizes.counts, experts, out_rows, scale,
                                      dst_is_permutation, expert_dim,
                                      GROUPED_ALIGNMENT if grouped_gemm_is_fast(x, weight) else 1)
    return _ExpertLinear.apply(x, weight, bias, scale, src, dst, sizes.as_list(), out_rows, dst_is_permutation,
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

    def forward(self, x: Tensor, src: Tensor, dst: Tensor, group_sizes: Union[GroupSizes, List[int]], out_rows: int,
                scale: Optional[Tensor] = None, dst_is_permutation: bool = False, add_bias: bool = True,
                experts: Optional[Tensor] = None) -> Tensor:
        """Routed rows only; see :func:`expert_linear`. ``add_bias=False`` leaves the bias to the caller."""
        return expert_linear(x, self.weight, self.bias if add_bias else None, src, dst, group_sizes, out_rows,
                             scale, dst_is_permutation, self.expert_dim, experts)

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
