"""FLOP formulas for the ops moa runs that torch's counter (``torch.utils.flop_counter``) does not count.

``FlopCounterMode`` counts an op only if it has a formula, and torch 2.13 has none for two that moa's
attention runs on every device: the grouped GEMM of the expert projections (``aten._grouped_mm``, MoA's
query and output experts, MoH's routed heads) and the CPU's fused attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: every model's attention core on a
CPU, fairseq's multi-head attention included). Without them a count leaves out the experts' projections
and q K^T and A V. :func:`register` (called when ``moa`` is imported) adds a formula for each op that has
none, so torch's own counter counts what moa computes:

* grouped GEMM: 2 * rows * in_dim * out_dim for (rows, in_dim) @ (E, in_dim, out_dim), where rows are
  those the groups cover (``offs[-1]``, a padded layout's zero rows within groups included, the unused
  rows after the last group not); the backward's (in_dim, rows) @ (rows, out_dim) per group alike;
* the CPU's fused attention: torch's formula for the CUDA kernels of the same contract.

A torch that counts these ops itself keeps its own formula.
"""

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _rows_covered(offs, rows: int) -> int:
    """The rows the groups cover: ``offs[-1]`` when the offsets hold values (an eager count), else every row
    (shapes only, as under a fake-tensor trace)."""
    from torch._subclasses.fake_tensor import is_fake

    if offs is None or is_fake(offs) or offs.device.type == "meta" or offs.numel() == 0:
        return rows
    return int(offs[-1])


def grouped_mm_flop(mat_a, mat_b, offs=None, *args, out_val=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm(mat_a, mat_b, offs)`` in each of its layouts:
    (M, K) @ (E, K, N) -> (M, N), groups of rows; (E, M, K) @ (K, N) -> (M, N), groups of columns;
    (K, M) @ (M, N) -> (E, K, N), groups of the contracted rows (the weight gradient); (E, M, K) @ (E, K, N)."""
    a, b = mat_a.shape, mat_b.shape
    if len(a) == 2 and len(b) == 3:
        return 2 * _rows_covered(offs, a[0]) * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * _rows_covered(offs, b[1])
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * _rows_covered(offs, a[1]) * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def register() -> None:
    """Give torch's counter a formula for each op of this module's docstring that has none."""
    import moa.experts  # noqa: F401  (defines moa::grouped_mm, the compilable grouped GEMM)

    formulas = {aten._grouped_mm: grouped_mm_flop, torch.ops.moa.grouped_mm: grouped_mm_flop}
    fused = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is not None:  # torch's formulas for the CUDA kernels, whose arguments start alike
        formulas[fused] = flop_registry[aten._scaled_dot_product_flash_attention]
        formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
            flop_registry[aten._scaled_dot_product_flash_attention_backward]
    for op, formula in formulas.items():
        if op not in flop_registry:
            flop_counter.register_flop_formula(op, get_raw=True)(formula)
