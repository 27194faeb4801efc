"""The fused gather -> expert matmul -> scatter-add autograd function."""

import pytest
import torch

from moa.dispatch import ExpertDispatch
from moa.experts import expert_chunks, expert_linear


def _naive(x, weight, bias, src, dst, group_sizes, out_rows, scale=None):
    out = x.new_zeros(out_rows, weight.size(-1))
    experts = torch.repeat_interleave(torch.arange(weight.size(0)), torch.tensor(group_sizes))
    for p in range(src.numel()):
        row = (x[src[p]] * (1 if scale is None else scale[p])) @ weight[experts[p]]
        out = out.index_add(0, dst[p:p + 1], (row + (bias[experts[p]] if bias is not None else 0))[None])
    return out


def test_matches_naive_loop_with_repeated_rows_and_an_empty_expert():
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    weight = torch.randn(4, 5, 3, dtype=torch.double, requires_grad=True)
    bias = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    scale = torch.rand(9, dtype=torch.double, requires_grad=True)
    group_sizes = [3, 0, 4, 2]  # expert 1 gets nothing
    src = torch.tensor([0, 2, 5, 1, 1, 3, 4, 0, 5])
    dst = torch.tensor([7, 0, 2, 2, 6, 1, 3, 7, 4])  # rows 2 and 7 receive two contributions; row 5 none
    got = expert_linear(x, weight, bias, src, dst, group_sizes, 8, scale=scale)
    want = _naive(x, weight, bias, src, dst, group_sizes, 8, scale=scale)
    torch.testing.assert_close(got, want)
    assert got[5].abs().sum() == 0
    probe = torch.randn_like(got)
    grads = torch.autograd.grad((got * probe).sum(), (x, weight, bias, scale))
    want_grads = torch.autograd.grad((want * probe).sum(), (x, weight, bias, scale))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    assert grads[1][1].abs().sum() == 0 and grads[2][1].abs().sum() == 0


def test_permutation_destination_is_copied_not_accumulated():
    torch.manual_seed(2)
    x = torch.randn(3, 4, dtype=torch.double)
    weight = torch.randn(2, 4, 5, dtype=torch.double)
    src, dst = torch.tensor([0, 2, 1, 0]), torch.tensor([3, 0, 2, 1])  # each of 4 rows written once
    got = expert_linear(x, weight, None, src, dst, [2, 2], 4, dst_is_permutation=True)
    torch.testing.assert_close(got, _naive(x, weight, None, src, dst, [2, 2], 4))


def test_gradcheck():
    torch.manual_seed(1)
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    weight = torch.randn(3, 3, 2, dtype=torch.double, requires_grad=True)
    src = torch.tensor([1, 3, 0, 2, 1])
    dst = torch.tensor([0, 1, 1, 2, 3])
    scale = torch.rand(5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, w, c: expert_linear(a, w, None, src, dst, [2, 1, 2], 4, scale=c), (x, weight, scale))


def test_dispatch_groups_by_expert_and_maps_to_the_attention_layout():
    experts = torch.tensor([[2, 0], [1, 2], [0, 1]])  # tokens n = t * bsz + b with tgt_len 3, bsz 1
    plan = ExpertDispatch(experts, num_experts=4, tgt_len=3, bsz=1)
    assert plan.group_sizes.counts.tolist() == [2, 2, 2, 0] and plan.expert.tolist() == [0, 0, 1, 1, 2, 2]
    sorted_experts = experts.reshape(-1)[plan.token * 2 + (plan.slot_row // 3)]
    assert sorted_experts.tolist() == [0, 0, 1, 1, 2, 2]
    # the (b=0, slot j, t) layout row of every assignment is unique and in range
    assert sorted(plan.slot_row.tolist()) == list(range(6))


def test_chunks_hold_whole_experts_within_the_row_limit(monkeypatch):
    import moa.experts

    monkeypatch.setattr(moa.experts, "CHUNK_ELEMENTS", 40)
    # width 10: at most 4 rows a chunk, an expert of more rows alone in its chunk
    assert expert_chunks([3, 0, 1, 6, 2, 2], 10) == [(0, 3, 0, 4), (3, 4, 4, 10), (4, 6, 10, 14)]
    assert expert_chunks([0, 0], 10) == [(0, 2, 0, 0)]


def test_a_projection_done_in_chunks_matches_the_naive_loop(monkeypatch):
    """Large projections go a few experts at a time; outputs and every gradient are unchanged."""
    import moa.experts

    torch.manual_seed(3)
    x = torch.randn(7, 5, dtype=torch.double, requires_grad=True)
    weight = torch.randn(4, 5, 3, dtype=torch.double, requires_grad=True)
    bias = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    scale = torch.rand(10, dtype=torch.double, requires_grad=True)
    group_sizes = [4, 0, 3, 3]
    src = torch.tensor([0, 2, 5, 6, 1, 3, 4, 0, 5, 6])
    dst = torch.tensor([7, 0, 2, 2, 6, 1, 3, 7, 4, 5])
    want = _naive(x, weight, bias, src, dst, group_sizes, 8, scale=scale)
    monkeypatch.setattr(moa.experts, "CHUNK_ELEMENTS", 10)  # 2 rows a chunk: every expert alone
    assert len(expert_chunks(group_sizes, 5)) == 3
    got = expert_linear(x, weight, bias, src, dst, group_sizes, 8, scale=scale)
    torch.testing.assert_close(got, want)
    probe = torch.randn_like(got)
    grads = torch.autograd.grad((got * probe).sum(), (x, weight, bias, scale))
    want_grads = torch.autograd.grad((want * probe).sum(), (x, weight, bias, scale))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    every_row_once = torch.tensor([3, 0, 2, 1, 7, 6, 5, 4])
    permuted = expert_linear(x, weight, None, src[:8], every_row_once, [4, 0, 3, 1], 8, dst_is_permutation=True)
    torch.testing.assert_close(permuted, _naive(x, weight, None, src[:8], every_row_once, [4, 0, 3, 1], 8))


def _case(dtype, seed=4):
    """Inputs with an empty expert, a repeated destination row and group sizes that are no multiple of 16."""
    torch.manual_seed(seed)
    group_sizes = [5, 0, 19, 1, 7]
    m = sum(group_sizes)
    x = torch.randn(23, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(5, 16, 8, dtype=dtype, requires_grad=True)
    bias = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    scale = torch.rand(m, dtype=dtype, requires_grad=True)
    src = torch.randint(0, 23, (m,))
    dst = torch.randint(0, 30, (m,))
    return (x, weight, bias, scale), src, dst, group_sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alignment", [1, 16])
def test_the_grouped_gemm_equals_the_loop_with_empty_and_unaligned_groups(dtype, alignment):
    """The contract of expert_linear, by torch's grouped GEMM (what CUDA takes in bfloat16; on CPU torch
    runs it group by group) and by the loop: the same outputs and gradients, also with every group padded
    to 16 rows as on CUDA."""
    from moa import experts

    inputs, src, dst, sizes = _case(dtype)
    x, weight, bias, scale = inputs
    loop = expert_linear(x, weight, bias, src, dst, sizes, 30, scale=scale, method="loop")
    flat_experts = torch.repeat_interleave(torch.arange(5), torch.tensor(sizes))
    grouped = experts._grouped_expert_linear(x, weight, bias, src, dst, torch.tensor(sizes), flat_experts, 30,
                                             scale, False, 0, alignment)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(grouped, loop, **tolerance)
    probe = torch.randn_like(loop)
    for a, b in zip(torch.autograd.grad((grouped * probe).sum(), inputs), torch.autograd.grad((loop * probe).sum(), inputs)):
        torch.testing.assert_close(a, b, **tolerance)


def test_bf16_blocks_padded_for_the_cpu_kernels_give_the_exact_rows():
    """In bfloat16 on a CPU the loop pads each block to a few shapes (gemm_rows): the padding rows change
    nothing, outputs and gradients equal the unpadded float64 loop's within bfloat16 rounding."""
    from moa.experts import gemm_rows

    inputs, src, dst, sizes = _case(torch.bfloat16)
    assert [gemm_rows(s, inputs[0]) for s in sizes] == [16, 0, 32, 16, 16]
    assert gemm_rows(19, inputs[0].double()) == 19
    wide = [t.detach().double().requires_grad_() for t in inputs]
    got = expert_linear(*inputs[:3], src, dst, sizes, 30, scale=inputs[3])
    want = _naive(*wide[:3], src, dst, sizes, 30, scale=wide[3])
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=5e-2)
    probe = torch.randn(30, 8, dtype=torch.double)
    for a, b in zip(torch.autograd.grad((got.double() * probe).sum(), inputs), torch.autograd.grad((want * probe).sum(), wide)):
        torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=1e-1)
    every_row_once = torch.randperm(src.numel())
    permuted = expert_linear(inputs[0], inputs[1], None, src, every_row_once, sizes, src.numel(), dst_is_permutation=True)
    torch.testing.assert_close(permuted.double(), _naive(wide[0], wide[1], None, src, every_row_once, sizes, src.numel()),
                               rtol=2e-2, atol=5e-2)
