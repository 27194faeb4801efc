"""Dispatch plans: where each (token, slot) assignment of a routing decision goes, computed once per
module forward from the routing decision and used by both of its expert projections.

With N tokens (flattened time-first, n = t * batch + b) each routed to k of E experts or heads there
are N * k assignments. A plan sorts them by expert, so that :func:`~moa.experts.expert_linear`
multiplies each expert's block of rows by that expert's weight only, and says which row of the
attention layout each assignment reads and writes:

* :class:`ExpertDispatch` (MoA): the (batch, k, tgt_len) layout of multi-query attention, one row per
  assignment, so the k routed query heads of a token attend over the one shared K/V head;
* :class:`HeadPacking` (MoH): the routed queries packed per (batch row, head), each head attending over
  its own K/V, in time order and padded to the longest group of the batch;
* :class:`HeadExpertDispatch` (SwitchHead): each token's k experts in every head, read from or
  written to the (batch, heads, len) layout of per-head attention.

Both count the block sizes on the device; MoA's plan reads nothing on the host, MoH's reads one number
(the packed layout's length is a shape), except under torch.compile, where it is the sequence length.
"""

import torch
from torch import Tensor


class ExpertDispatch:
    """Where each (token, slot) assignment of a routing decision goes.

    experts: (N, k) selected expert of each slot, tokens flattened time-first
    (n = t * batch + b). Sorted by expert, assignment p of the sorted order is
    token ``token[p]``, and row ``slot_row[p]`` of the attention layout
    (batch, k, tgt_len) flattened, i.e. ``(b * k + j) * tgt_len + t``; ``order[p]``
    is the assignment index n * k + j itself.
    ``counts`` (E,) holds the block lengths, counted on the device (no host read here), and
    ``expert[p]`` the expert of assignment p; every shape is static, so the plan compiles whole.
    """

    def __init__(self, experts: Tensor, num_experts: int, tgt_len: int, bsz: int):
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        self.order = order = flat.argsort(stable=True)  # sorted position -> assignment
        self.expert = flat[order]
        self.token = order // top_k
        slot = order % top_k
        t, b = self.token // bsz, self.token % bsz
        self.slot_row = (b * top_k + slot) * tgt_len + t
        self.counts = _count(flat, num_experts)
        self.num_tokens = num_tokens
        self.num_slot_rows = num_tokens * top_k


class HeadPacking:
    """Where each (token, slot) assignment to a routed head goes in the packed attention layout.

    heads: (N, K) selected routed head per slot, tokens flattened time-first (n = t * bsz + b).
    The layout is (bsz, E, length, D): group (b, e) holds, in time order, the queries of row b
    that selected head e, ``length`` being the largest group. Sorted by head, assignment p is
    token ``token[p]`` and packed row ``packed_row[p]``; ``order[p]`` is the assignment index
    n * K + j. ``position`` (bsz, E, length) is each packed row's time step (empty rows: the
    last one, so that they see some key and stay finite); ``counts`` (E,) the assignments per head.
    One host read: the length (under torch.compile none: the length is tgt_len).
    """

    def __init__(self, heads: Tensor, num_heads: int, tgt_len: int, bsz: int):
        num_tokens, top_k = heads.shape
        flat = heads.reshape(-1)
        token = torch.arange(num_tokens, device=heads.device).repeat_interleave(top_k)
        t, b = token // bsz, token % bsz
        group = b * num_heads + flat
        by_group = group.argsort(stable=True)  # within a group: token order, i.e. time order
        counts = _count(group, bsz * num_heads)
        self.counts = _count(flat, num_heads)
        # the plan's one host read; a compiled graph takes the sequence length instead (the longest a group
        # can be): static shapes, one graph whatever the routing, at the cost of attention over padded rows
        self.length = tgt_len if torch.compiler.is_compiling() else counts.max().item()
        sorted_group = group[by_group]
        rank = torch.arange(flat.numel(), device=heads.device) - (counts.cumsum(0) - counts)[sorted_group]
        packed_row = torch.empty_like(flat)
        packed_row[by_group] = sorted_group * self.length + rank
        position = torch.full((bsz * num_heads * self.length,), tgt_len - 1, dtype=torch.long, device=heads.device)
        position[packed_row] = t
        self.position = position.view(bsz, num_heads, self.length)
        self.order = flat.argsort(stable=True)  # by head, for the projections
        self.expert = flat[self.order]
        self.token = token[self.order]
        self.packed_row = packed_row[self.order]
        self.batch_time_row = (b * tgt_len + t)[self.order]  # row of (bsz * tgt_len) weights
        self.num_packed_rows = bsz * num_heads * self.length


class HeadExpertDispatch:
    """Where each (token, head, slot) assignment of a SwitchHead selection goes.

    experts: (N, H * k) selected experts numbered h * E + e, head by head, tokens flattened time-first
    (n = t * bsz + b). Sorted by expert, assignment p is token ``token[p]`` and row ``head_row[p]`` of
    the attention layout (bsz, H, length) flattened, ``(b * H + h) * length + t``; ``counts`` (H * E,)
    the block lengths, ``expert[p]`` the expert. The value projection reads ``token`` rows and sums into
    ``head_row`` rows; the output projection the other way round. No host read."""

    def __init__(self, experts: Tensor, num_heads: int, num_experts: int, length: int, bsz: int):
        num_tokens, slots = experts.shape
        top_k = slots // num_heads
        flat = experts.reshape(-1)
        self.order = order = flat.argsort(stable=True)  # sorted position -> assignment n * H * k + h * k + j
        self.expert = flat[order]
        self.token = order // slots
        head = (order % slots) // top_k
        t, b = self.token // bsz, self.token % bsz
        self.head_row = (b * num_heads + head) * length + t
        self.counts = _count(flat, num_heads * num_experts)


def _count(values: Tensor, size: int) -> Tensor:
    """(size,) occurrences of each of 0..size-1 in ``values``; ``torch.bincount`` would read the values'
    range on the host first (on CUDA)."""
    return torch.zeros(size, dtype=torch.long, device=values.device).scatter_add_(0, values, torch.ones_like(values))
