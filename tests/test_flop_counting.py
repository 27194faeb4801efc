"""torch's FLOP counter counts what MoA, MoH and SwitchHead compute (moa.flops): the experts' grouped GEMM and the CPU's
fused attention included, on the path training runs (fused attention, no weights) and on the one that returns
attention weights (plain matmuls), in float32 and bfloat16.

The analytic counts are written from the method's equations: every selected (token, expert) pair's query and
output projection, the shared key/value projections, the router, and attention over the keys; in bfloat16
the grouped GEMM also multiplies the zero rows that pad each expert's group on a CPU (moa.experts.padded_counts),
which are counted as computed."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moa.experts import padded_counts
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.switchhead_attention import SwitchHeadAttention

DTYPES = [torch.float32, torch.bfloat16]


def counted_macs(module, x, need_weights=False, **kwargs):
    with FlopCounterMode(display=False) as counter:
        module(x, x, x, need_weights=need_weights, **kwargs)
    return counter.get_total_flops() / 2


def grouped_rows(counts, x, assignments):
    """Rows the grouped GEMM multiplies: the assignments, each group padded where the dtype asks for it."""
    padding = padded_counts(counts, x, assignments)
    return assignments if padding is None else int(padding[0].sum())


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused-attention", "attention-as-matmuls"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts", [8, 32])
def test_moa_module_counts_the_selected_experts(dtype, num_experts, need_weights):
    torch.manual_seed(0)
    d, k, head, T, B = 256, 4, 64, 40, 2
    m = MixtureOfAttentionHeads(d, num_experts, k, head, self_attention=True).to(dtype)
    x = torch.randn(T, B, d, dtype=dtype)
    macs = counted_macs(m, x, need_weights)
    n = T * B
    counts = torch.bincount(m.routing.selected.reshape(-1), minlength=num_experts)
    rows = grouped_rows(counts, x, n * k)
    expected = (n * d * num_experts          # router W_g
                + rows * d * head * 2        # the selected experts' W_q^i and W_o^i
                + n * d * head * 2           # shared W_k, W_v
                + B * k * T * T * head * 2)  # q K^T and A V, k query heads over one K/V head
    assert macs == pytest.approx(expected, rel=1e-9)
    if dtype == torch.float32:  # no padding: the method's own count, which grows with k, not with E
        assert rows == n * k


@pytest.mark.parametrize("dtype", DTYPES)
def test_moh_module_counts_the_active_heads(dtype):
    torch.manual_seed(0)
    d, heads, shared, k, T, B = 256, 8, 2, 2, 40, 2
    m = MixtureOfHeadsAttention(d, heads, shared, k, self_attention=True).to(dtype)
    x = torch.randn(T, B, d, dtype=dtype)
    macs = counted_macs(m, x)
    n, head, routed = T * B, d // heads, heads - shared
    selected = m.routing.selected.reshape(T, B, k)
    group = torch.stack([torch.bincount(selected[:, b].reshape(-1), minlength=routed) for b in range(B)])
    length = int(group.max())  # the packed layout's groups: one per (row, head), padded to the longest
    rows = grouped_rows(group.sum(0), x, n * k)
    expected = (n * d * (heads + 2)                   # router W_s, W_r, W_h
                + n * d * d * 2                       # every head's keys and values
                + n * d * shared * head * 2           # shared heads' queries and output
                + rows * d * head * 2                 # routed heads' queries and output, selected rows only
                + B * shared * T * T * head * 2       # shared heads' attention
                + B * routed * length * T * head * 2)  # routed heads' attention over the packed queries
    assert macs == pytest.approx(expected, rel=1e-9)



@pytest.mark.parametrize("need_weights", [False, True], ids=["fused-attention", "attention-as-matmuls"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_switchhead_module_counts_the_selected_value_and_output_experts(dtype, need_weights):
    """SwitchHead (moa.switchhead_attention) on its routed path: the dense Q and K, each head's k value experts
    per source token and k output experts per query token, the two sigmoid selections, attention per head."""
    torch.manual_seed(0)
    d, heads, experts, k, head, T, B = 256, 2, 4, 2, 56, 40, 2
    m = SwitchHeadAttention(d, heads, experts, k, head, self_attention=True).to(dtype)
    m.path = "routed"
    x = torch.randn(T, B, d, dtype=dtype)
    macs = counted_macs(m, x, need_weights)
    n = T * B
    value_routing = m.value_router(x.reshape(n, d), aux=False)
    rows = [grouped_rows(torch.bincount(r.selected.reshape(-1), minlength=heads * experts), x, n * heads * k)
            for r in (value_routing, m.routing)]
    expected = (2 * n * d * heads * experts      # the value and output selections
                + 2 * n * d * heads * head       # dense W_q and W_k
                + (rows[0] + rows[1]) * d * head  # the selected value and output experts
                + B * heads * T * T * head * 2)  # q K^T and A V per head
    assert macs == pytest.approx(expected, rel=1e-9)
    if dtype == torch.float32:
        assert rows == [n * heads * k] * 2
