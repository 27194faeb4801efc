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


def _compare(got, want, inputs, wide_inputs=None, **tolerance):
    """Outputs and the gradient of every input equal; ``wide_inputs``: the reference's own leaves."""
    torch.testing.assert_close(got.to(want.dtype), want, **tolerance)
    probe = torch.randn(want.shape, dtype=want.dtype)
    grads = torch.autograd.grad((got.to(want.dtype) * probe).sum(), inputs)
    want_grads = torch.autograd.grad((want * probe).sum(), wide_inputs or inputs)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.to(w.dtype), w, **tolerance)
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


def test_permutation_destination_is_copied_not_accumulated():
    torch.manual_seed(2)
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, 4, 5, dtype=torch.double, requires_grad=True)
    src, dst, counts = torch.tensor([0, 2, 1, 0]), torch.tensor([3, 0, 2, 1]), torch.tensor([2, 2])
    got = expert_linear(x, weight, None, src, dst, counts, 4, dst_is_permutation=True)
    _compare(got, loop_reference(x, weight, None, src, dst, counts, 4), (x, weight))


def test_gradcheck_with_the_expert_axis_in_the_middle():
    """The (in_dim, E, out_dim) layout of MoA's query experts, read through a strided view."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_equals_the_loop_forward_and_backward(dtype):
    """float32: the loop's outputs and gradients exactly; bfloat16 (groups padded for the CPU's kernels):
    the float64 loop's within bfloat16 rounding."""
    inputs, src, dst, counts = _case(dtype)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    reference = inputs if dtype == torch.float32 else wide
    want = loop_reference(*reference[:3], src, dst, counts, 30, reference[3])
    got = expert_linear(*inputs[:3], src, dst, counts, 30, scale=inputs[3])
    tolerance = {} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 1e-1}
    _compare(got, want, inputs, None if dtype == torch.float32 else wide, **tolerance)
    every_row_once = torch.randperm(src.numel())
    permuted = expert_linear(inputs[0], inputs[1], None, src, every_row_once, counts, src.numel(),
                             dst_is_permutation=True)
    want = loop_reference(reference[0], reference[1], None, src, every_row_once, counts, src.numel())
    _compare(permuted, want, inputs[:2], None if dtype == torch.float32 else wide[:2], **tolerance)


def test_half_precision_groups_are_padded_to_a_few_row_counts_on_a_cpu():
    """bfloat16 on a CPU: at least 16 rows, then a multiple of an eighth of the power of two below the
    count, within the layout's static size; float32 is not padded."""
    counts = torch.tensor([5, 0, 19, 1, 300, 256, 257])
    x = torch.zeros(1, 4, dtype=torch.bfloat16)
    padded, rows = padded_counts(counts, x, int(counts.sum()))
    assert padded.tolist() == [16, 0, 32, 16, 320, 256, 288]
    assert int(padded.sum()) <= rows
    assert padded_counts(counts, x.float(), int(counts.sum())) is None
