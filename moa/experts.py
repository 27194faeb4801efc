"""Expert projections that only see the rows routed to them, on torch's grouped GEMM.

MoA gives every expert i its own query projection W_q^i (d_model -> D) and output projection W_o^i
(D -> d_model). With N tokens each routed to k experts there are M = N*k (token, slot) assignments. A
dispatch plan (:mod:`moa.dispatch`) sorts them by expert once per module; :func:`expert_linear` then
multiplies each expert's block of rows by that expert's weight only (M rows of work, never N*E), all
experts in one ``torch.nn.functional.grouped_mm``, on every device, differentiated by autograd:

    out[dst] += (scale * x[src]) @ W[e] (+ b[e])      gather, grouped GEMM, scatter

The group offsets are a ``cumsum`` on the device: no host read. Where a kernel wants it the groups are
padded with zero rows (:func:`padded_counts`), into a layout of a static number of rows, so that the
projection compiles whole (``torch.compile(fullgraph=True)``).
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CUDA_ALIGNMENT = 16  # rows per group the CUDA kernel wants in bfloat16 and float16
CPU_MIN_BLOCK = 16  # the smallest padded group on a CPU in bfloat16 and float16


def padded_counts(counts: Tensor, x: Tensor, assignments: int) -> Optional[Tuple[Tensor, int]]:
    """(padded rows per group (E,), static layout rows) where the grouped GEMM wants padded groups, else None.

    CUDA in bfloat16/float16: each group to a multiple of 16 rows (the kernel's alignment; at most
    E * 15 more rows). A CPU in bfloat16/float16: each group to a multiple of an eighth of the power of
    two below its size, at least 16 rows, since oneDNN compiles a kernel for every new row count at
    about ten times the cost of the product: about eight shapes per octave, at most 1/8 + 16 E more rows.
    float32 and float64 need no padding."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return None
    num_experts = counts.numel()
    if x.is_cuda:
        return (counts + CUDA_ALIGNMENT - 1) // CUDA_ALIGNMENT * CUDA_ALIGNMENT, \
            assignments + num_experts * (CUDA_ALIGNMENT - 1)
    bits = torch.floor(torch.log2(counts.clamp(min=1).to(torch.float64))).long() + 1  # bit_length for counts >= 1
    step = torch.pow(2, (bits - 4).clamp(min=int(math.log2(CPU_MIN_BLOCK))))
    return (counts + step - 1) // step * step, assignments + assignments // 8 + CPU_MIN_BLOCK * num_experts


def grouped_mm(rows: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """rows (R, in_dim) @ w (E, in_dim, out_dim) group by group, group e ending at row ``ends[e]``: torch's
    grouped GEMM. Where it has no kernel: float64 (the tests' exact references) group by group; rows or
    strides of other than whole 16-byte units (widths no real model has) in float32, and group by group
    where float32's are not whole units either. Under torch.compile, other dtypes than bfloat16 go through
    :func:`compilable_grouped_mm`."""
    if rows.dtype == torch.float64:
        return looped_mm(rows, w, ends)
    if any(stride * t.element_size() % 16 for t in (rows, w) for stride in t.stride() if stride != 1):
        if rows.dtype == torch.float32:
            return looped_mm(rows, w, ends)
        return grouped_mm(rows.float(), w.float(), ends).to(rows.dtype)
    if torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
        return compilable_grouped_mm(rows, w, ends.to(torch.int32))
    return F.grouped_mm(rows, w, offs=ends.to(torch.int32))


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as an op of its own, for torch.compile: torch 2.13's shape function
    of the grouped GEMM refuses every dtype but bfloat16, though the CPU's kernel multiplies float32 (and
    float16), so a compiled float32 model would fail. Layouts: (R, K) @ (E, K, N) -> (R, N), and the weight
    gradient's (K, R) @ (R, N) -> (E, K, N); the backward is made of the same op."""
    return F.grouped_mm(a, b, offs=offs)


def _grouped_mm_fake(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.size(0), b.size(2))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors  # forward layout (R, K) @ (E, K, N): the only one differentiated
    grad_a = compilable_grouped_mm(grad, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_b = compilable_grouped_mm(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _save_for_backward(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


if hasattr(torch.ops.moa, "grouped_mm"):  # defined by another copy of this file (an exported model's)
    compilable_grouped_mm = torch.ops.moa.grouped_mm
else:
    compilable_grouped_mm = torch.library.custom_op("moa::grouped_mm", mutates_args=())(_grouped_mm)
    compilable_grouped_mm.register_fake(_grouped_mm_fake)
    compilable_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_save_for_backward)


def looped_mm(rows: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """:func:`grouped_mm` as one matmul per expert, the offsets read on the host; rows past the last group
    (a padded layout's) come out zero."""
    bounds = [0] + ends.tolist()
    pieces = [rows[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(pieces + [rows.new_zeros(rows.size(0) - bounds[-1], w.size(-1))])


def expert_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], src: Tensor, dst: Tensor, counts: Tensor,
                  out_rows: int, scale: Optional[Tensor] = None, dst_is_permutation: bool = False,
                  expert_dim: int = 0, experts: Optional[Tensor] = None, scale_output: bool = False) -> Tensor:
    """Grouped expert projection with gather, row scaling and scatter-add built in.

    x: (rows_in, in_dim); weight: (E, in_dim, out_dim), or (in_dim, E, out_dim) with ``expert_dim=1``;
    bias: (E, out_dim) or None; src, dst: (M,) row indices, sorted by expert in blocks of ``counts``
    (E,) int64 on the device; scale: (M,) per-assignment factor on the gathered row (MoA's gate weight),
    or None, applied to the product instead with ``scale_output`` (the same by linearity, without a bias;
    cheaper where out_dim < in_dim); experts: (M,) the expert of each assignment (derived from the counts
    when not given).
    Returns (out_rows, out_dim) with ``out[dst[p]] = sum of (scale[p] * x[src[p]]) @ weight[e(p)] (+ bias[e(p)])``.
    Rows of dst that no assignment names stay zero and repeated dst rows are summed (on CUDA in a
    nondeterministic order, as index_add is there), unless ``dst_is_permutation`` promises that dst
    names each of the out_rows exactly once. Under autocast it runs in the autocast dtype, as ``F.linear``.
    """
    if torch.is_autocast_enabled(x.device.type):  # grouped_mm is not on autocast's lists: cast as a matmul would be
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias, scale = (None if t is None else t.to(dtype) for t in (bias, scale))
    w = weight if expert_dim == 0 else weight.transpose(0, 1)  # (E, in_dim, out_dim)
    if scale_output and bias is not None:
        raise ValueError("scale_output scales the product: give the bias to the caller (it would be scaled too)")
    rows = x.index_select(0, src)
    if scale is not None and not scale_output:
        rows = rows * scale.unsqueeze(1)
    assignments = src.numel()
    padding = padded_counts(counts, rows, assignments)
    if (padding is not None or bias is not None) and experts is None:
        experts = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                          output_size=assignments)
    if padding is None:
        y = grouped_mm(rows, w, counts.cumsum(0))
    else:
        padded, layout_rows = padding
        ends = padded.cumsum(0)
        at = torch.arange(assignments, device=x.device) + ((ends - padded) - (counts.cumsum(0) - counts))[experts]
        layout = rows.new_zeros(layout_rows, rows.size(1)).index_copy(0, at, rows)
        y = grouped_mm(layout, w, ends).index_select(0, at)
    if bias is not None:  # gathered in float32 at least, so that its gradient is summed in float32
        y = y + bias.to(torch.promote_types(bias.dtype, torch.float32))[experts].to(y.dtype)
    if scale is not None and scale_output:
        y = y * scale.unsqueeze(1)
    if dst_is_permutation:  # every row written once: no zero fill, no accumulation
        return y.new_empty(out_rows, y.size(1)).index_copy_(0, dst, y)
    return y.new_zeros(out_rows, y.size(1)).index_add_(0, dst, y)


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

    def forward(self, x: Tensor, src: Tensor, dst: Tensor, counts: Tensor, out_rows: int,
                scale: Optional[Tensor] = None, dst_is_permutation: bool = False, add_bias: bool = True,
                experts: Optional[Tensor] = None) -> Tensor:
        """Routed rows only; see :func:`expert_linear`. ``add_bias=False`` leaves the bias to the caller."""
        return expert_linear(x, self.weight, self.bias if add_bias else None, src, dst, counts, out_rows,
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
