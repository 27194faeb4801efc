"""Expert projections on torch's grouped GEMM against a loop over the experts, the reference."""

import pytest
import torch

from moa.dispatch import ExpertDispatch
from moa.experts import expert_linear, padded_counts


def loop_reference(x, weight, bias, src, dst, counts, out_rows, scale=None):
    """out[dst[p]] += (scale[p] * x[src[p]]) @ weight[e] (+ bias[e]), expert by expert."""
    out = x.new_zeros(out_rows, weight.size(-1))
    start = 0
    for e, size in enumerate(counts.tolist()):
        block = slice(start, start + size)
        rows = x[src[block]] * (1 if scale is None else scale[block].unsqueeze(1))
        y = rows @ weight[e] + (0 if bias is None else bias[e])
        out = out.index_add(0, dst[block], y)
        start += size
    return out


def assert_within_half_precision_rounding(function, reference, inputs, factor=8):
    """``function(*inputs)`` in bfloat16 or float16 against ``reference`` of the same inputs in float64:
    the output and the gradient of every input within ``factor * eps`` of the same sums over the terms'
    magnitudes (the reference of |inputs|). That is the bound of a few roundings of each product, partial
    sum and stored result, which a cancelling sum can make large beside the result itself; a wrong or
    missing term is of the order of the magnitude, far outside it."""
    bound = factor * torch.finfo(inputs[0].dtype).eps
    wide = [t.detach().double().requires_grad_() for t in inputs]
    size_leaves = [t.detach().double().abs().requires_grad_() for t in inputs]
    got, want, size = function(*inputs), reference(*wide), reference(*size_leaves)
    probe = torch.randn(want.shape, dtype=torch.float64, device=want.device)
    checks = [("output", got.double(), want, size)]
    grads = torch.autograd.grad((got.double() * probe).sum(), inputs)
    want_grads = torch.autograd.grad((want * probe).sum(), wide)
    size_grads = torch.autograd.grad((size * probe.abs()).sum(), size_leaves)
    checks += [(f"gradient of input {i}", *g) for i, g in enumerate(zip(grads, want_grads, size_grads))]
    for what, g, w, m in checks:
        excess = (g.double() - w).abs() - bound * m
        assert excess.max() <= 0, f"{what}: off by {(g.double() - w).abs().max():.3g}, beyond {bound:.3g} of the terms' magnitude"


def _compare(got, want, inputs):
    """Outputs and the gradient of every input equal: float64 (the loop on both sides, sums in another order:
    a few 1e-16 of terms of order 1-10) to 1e-12; float32 (the grouped GEMM against the loop) within
    torch's float32 defaults, rtol 1.3e-6 = 11 eps, for dot products of 16 terms."""
    tol = dict(rtol=1e-12, atol=1e-12) if want.dtype == torch.float64 else {}
    torch.testing.assert_close(got, want, **tol)
    probe = torch.randn(want.shape, dtype=want.dtype)
    grads = torch.autograd.grad((got * probe).sum(), inputs)
    want_grads = torch.autograd.grad((want * probe).sum(), inputs)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **tol)
    return grads


def test_matches_the_loop_with_repeated_rows_and_an_empty_expert():
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    weight = torch.randn(4, 5, 3, dtype=torch.double, requires_grad=True)
    bias = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    scale = torch.rand(9, dtype=torch.double, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 2])  # expert 1 gets nothing
    src = torch.tensor([0, 2, 5, 1, 1, 3, 4, 0, 5])
    dst = torch.tensor([7, 0, 2, 2, 6, 1, 3, 7, 4])  # rows 2 and 7 receive two contributions; row 5 none
    got = expert_linear(x, weight, bias, src, dst, counts, 8, scale=scale)
    assert got[5].abs().sum() == 0
    grads = _compare(got, loop_reference(x, weight, bias, src, dst, counts, 8, scale), (x, weight, bias, scale))
    assert grads[1][1].abs().sum() == 0 and grads[2][1].abs().sum() == 0


WRONG_BY = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 0.25}  # beyond each comparison's tolerance


@pytest.mark.parametrize("dtype", list(WRONG_BY), ids=str)
def test_a_wrong_row_scale_or_destination_fails_the_comparisons(dtype):
    """Negative controls of the loop comparisons (default tolerances in float64 and float32, bfloat16's
    rounding bound): a reference that scales one routed row by 1 + WRONG_BY, or sends one assignment to
    another destination row, differs beyond them."""
    inputs, src, dst, counts = _case(dtype)
    factor = torch.ones(src.numel(), dtype=dtype)
    factor[3] += WRONG_BY[dtype]
    wrong_dst = dst.clone()
    wrong_dst[0] = (dst[0] + 1) % 30

    def function(x, w, b, c):
        return expert_linear(x, w, b, src, dst, counts, 30, scale=c)

    for reference in (lambda x, w, b, c: loop_reference(x, w, b, src, dst, counts, 30, c * factor.to(c.dtype)),
                      lambda x, w, b, c: loop_reference(x, w, b, src, wrong_dst, counts, 30, c)):
        with pytest.raises(AssertionError):
            if dtype == torch.bfloat16:
                assert_within_half_precision_rounding(function, reference, inputs)
            else:
                _compare(function(*inputs), reference(*inputs), inputs)


def test_permutation_destination_is_copied_not_accumulated():
    torch.manual_seed(2)
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, 4, 5, dtype=torch.double, requires_grad=True)
    src, dst, counts = torch.tensor([0, 2, 1, 0]), torch.tensor([3, 0, 2, 1]), torch.tensor([2, 2])
    got = expert_linear(x, weight, None, src, dst, counts, 4, dst_is_permutation=True)
    _compare(got, loop_reference(x, weight, None, src, dst, counts, 4), (x, weight))


def test_gradcheck_with_the_expert_axis_in_the_middle():
    """The (in_dim, E, out_dim) layout of MoA's query experts, read through a strided view, in float64 (the
    loop); float32 and bfloat16 on the grouped GEMM: test_the_grouped_gemm_equals_the_loop_forward_and_backward."""
    torch.manual_seed(1)
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    weight = torch.randn(3, 3, 2, dtype=torch.double, requires_grad=True)
    src, dst, counts = torch.tensor([1, 3, 0, 2, 1]), torch.tensor([0, 1, 1, 2, 3]), torch.tensor([2, 1, 2])
    scale = torch.rand(5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, w, c: expert_linear(a, w, None, src, dst, counts, 4, scale=c, expert_dim=1), (x, weight, scale))


def test_dispatch_groups_by_expert_and_maps_to_the_attention_layout():
    experts = torch.tensor([[2, 0], [1, 2], [0, 1]])  # tokens n = t * bsz + b with tgt_len 3, bsz 1
    plan = ExpertDispatch(experts, num_experts=4, tgt_len=3, bsz=1)
    assert plan.counts.tolist() == [2, 2, 2, 0] and plan.expert.tolist() == [0, 0, 1, 1, 2, 2]
    sorted_experts = experts.reshape(-1)[plan.token * 2 + (plan.slot_row // 3)]
    assert sorted_experts.tolist() == [0, 0, 1, 1, 2, 2]
    # the (b=0, slot j, t) layout row of every assignment is unique and in range
    assert sorted(plan.slot_row.tolist()) == list(range(6))


def _case(dtype, seed=4):
    """Inputs with an empty expert, a repeated destination row and group sizes that are no multiple of 16."""
    torch.manual_seed(seed)
    counts = torch.tensor([5, 0, 19, 1, 300])
    m = int(counts.sum())
    x = torch.randn(23, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(5, 16, 8, dtype=dtype, requires_grad=True)
    bias = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    scale = torch.rand(m, dtype=dtype, requires_grad=True)
    return (x, weight, bias, scale), torch.randint(0, 23, (m,)), torch.randint(0, 30, (m,)), counts


@pytest.mark.parametrize("expert_dim", [0, 1], ids=["contiguous-experts", "strided-experts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_equals_the_loop_forward_and_backward(dtype, expert_dim):
    """float32: the loop's outputs and gradients exactly; bfloat16 (groups padded for the CPU's kernels):
    the float64 loop's within bfloat16 rounding. expert_dim=1 is MoA's query experts, (in_dim, E, out_dim),
    which the grouped GEMM reads through a strided view."""
    inputs, src, dst, counts = _case(dtype)
    if expert_dim == 1:  # the same weights stored in the other layout
        x, weight, bias, scale = inputs
        weight = weight.detach().transpose(0, 1).contiguous().requires_grad_()
        inputs = (x, weight, bias, scale)
        assert not weight.transpose(0, 1).is_contiguous()

    def experts_first(w):
        return w if expert_dim == 0 else w.transpose(0, 1)

    every_row_once = torch.randperm(src.numel())
    cases = [(lambda x, w, b, c: expert_linear(x, w, b, src, dst, counts, 30, scale=c, expert_dim=expert_dim),
              lambda x, w, b, c: loop_reference(x, experts_first(w), b, src, dst, counts, 30, c), inputs),
             (lambda x, w: expert_linear(x, w, None, src, every_row_once, counts, src.numel(), dst_is_permutation=True,
                                         expert_dim=expert_dim),
              lambda x, w: loop_reference(x, experts_first(w), None, src, every_row_once, counts, src.numel()),
              inputs[:2])]
    for function, reference, leaves in cases:
        if dtype == torch.float32:
            _compare(function(*leaves), reference(*leaves), leaves)
        else:
            assert_within_half_precision_rounding(function, reference, leaves)


def test_widths_of_no_whole_16_bytes_fall_back_to_the_loop_in_float32():
    """The grouped GEMM wants strides of whole 16-byte units; float32 with a width of 6 (no real model's) is
    multiplied group by group, bfloat16 in float32 first."""
    torch.manual_seed(3)
    counts, src, dst = torch.tensor([2, 3]), torch.tensor([0, 1, 2, 3, 0]), torch.tensor([4, 3, 2, 1, 0])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 6, dtype=dtype, requires_grad=True)
        weight = torch.randn(2, 6, 6, dtype=dtype, requires_grad=True)
        got = expert_linear(x, weight, None, src, dst, counts, 5)
        if dtype == torch.float32:
            _compare(got, loop_reference(x, weight, None, src, dst, counts, 5), (x, weight))
        else:
            assert_within_half_precision_rounding(lambda a, w: expert_linear(a, w, None, src, dst, counts, 5),
                                                  lambda a, w: loop_reference(a, w, None, src, dst, counts, 5),
                                                  (x, weight))


def test_half_precision_groups_are_padded_to_a_few_row_counts_on_a_cpu():
    """bfloat16 on a CPU: at least 16 rows, then a multiple of an eighth of the power of two below the
    count, within the layout's static size; float32 is not padded."""
    counts = torch.tensor([5, 0, 19, 1, 300, 256, 257])
    x = torch.zeros(1, 4, dtype=torch.bfloat16)
    padded, rows = padded_counts(counts, x, int(counts.sum()))
    assert padded.tolist() == [16, 0, 32, 16, 320, 256, 288]
    assert int(padded.sum()) <= rows
    assert padded_counts(counts, x.float(), int(counts.sum())) is None


def test_scaling_the_product_equals_scaling_the_rows_and_refuses_a_bias():
    """``scale_output`` (SwitchHead's value experts: the product is narrower than the row) gives the output and
    gradients of scaling the gathered rows, in float64; with a bias it would scale the bias too, so it refuses."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    src = torch.tensor([0, 3, 1, 1, 4, 5, 2])
    dst = torch.tensor([2, 0, 1, 3, 3, 2, 0])
    counts = torch.tensor([2, 3, 2])
    scale = torch.rand(7, dtype=torch.float64, requires_grad=True)
    results = []
    for scale_output in (False, True):
        y = expert_linear(x, w, None, src, dst, counts, 4, scale=scale, scale_output=scale_output)
        grads = torch.autograd.grad((y * torch.arange(8.0, dtype=torch.float64).view(4, 2)).sum(), (x, w, scale))
        results.append((y, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="scale_output"):
        expert_linear(x, w, torch.zeros(3, 2, dtype=torch.float64), src, dst, counts, 4, scale=scale, scale_output=True)
