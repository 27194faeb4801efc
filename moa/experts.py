"""Expert projections that only see the tokens routed to them.

MoA gives every expert i its own query projection W_q^i (d_model -> D) and
output projection W_o^i (D -> d_model). With N tokens each routed to k experts
there are N*k (token, slot) assignments; :class:`ExpertDispatch` sorts them by
expert once per forward, and :class:`ExpertLinear` multiplies each expert's
contiguous block of rows by that expert's weight, so the work is N*k rows in
all, never N*E.
"""

import math
from typing import List, Optional

import torch
from torch import Tensor, nn


class ExpertDispatch:
    """Groups the (token, slot) assignments of a routing decision by expert.

    experts: (N, k) selected expert of each slot. Assignment a = t*k + j is
    token t's j-th slot. After sorting, the rows of expert 0 come first, then
    expert 1, and so on; ``group_sizes`` holds the E block lengths (one host
    synchronisation for the whole layer, not one per expert).
    """

    def __init__(self, experts: Tensor, num_experts: int):
        self.num_tokens, self.top_k = experts.shape
        flat = experts.reshape(-1)
        self.order = flat.argsort(stable=True)  # sorted position -> assignment index
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(self.order.numel(), device=flat.device)
        self.token_index = self.order // self.top_k  # sorted position -> token
        self.group_sizes: List[int] = torch.bincount(flat, minlength=num_experts).tolist()

    def gather_tokens(self, x: Tensor) -> Tensor:
        """(N, C) tokens -> (N*k, C) one row per assignment, grouped by expert."""
        return x.index_select(0, self.token_index)

    def sort(self, slots: Tensor) -> Tensor:
        """(N, k, C) per-slot rows -> (N*k, C) grouped by expert."""
        return slots.reshape(-1, slots.size(-1)).index_select(0, self.order)

    def unsort(self, grouped: Tensor) -> Tensor:
        """(N*k, C) rows grouped by expert -> (N, k, C) in token/slot order."""
        return grouped.index_select(0, self.inverse).view(self.num_tokens, self.top_k, -1)


class ExpertLinear(nn.Module):
    """E independent linear maps ``in_dim -> out_dim``.

    weight: (E, in_dim, out_dim); bias: (E, out_dim) or None. Each expert is
    initialised like an ``nn.Linear(in_dim, out_dim)`` with Xavier-uniform.
    """

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, bias: bool = False):
        super().__init__()
        self.num_experts, self.in_dim, self.out_dim = num_experts, in_dim, out_dim
        self.weight = nn.Parameter(torch.empty(num_experts, in_dim, out_dim))
        self.bias = nn.Parameter(torch.zeros(num_experts, out_dim)) if bias else None
        bound = math.sqrt(6.0 / (in_dim + out_dim))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, grouped: Tensor, group_sizes: List[int]) -> Tensor:
        """grouped: (M, in_dim) rows sorted by expert with ``group_sizes`` rows each -> (M, out_dim)."""
        # unbind once: indexing weight[e] per expert would make autograd build a full-size
        # zero gradient for every expert (E times the weight's memory traffic).
        weights = self.weight.unbind(0)
        biases = self.bias.unbind(0) if self.bias is not None else [None] * self.num_experts
        outputs = []
        for rows, weight, bias in zip(grouped.split(group_sizes), weights, biases):
            outputs.append(rows @ weight if bias is None else torch.addmm(bias, rows, weight))
        return torch.cat(outputs) if outputs else grouped.new_zeros(0, self.out_dim)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_dim={self.in_dim}, out_dim={self.out_dim}, bias={self.bias is not None}"
