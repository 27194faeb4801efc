"""Top-k routing of tokens to attention experts (MoA, Zhang et al. 2022, Sec. 3.1-3.2).

For a token x_t the router computes logits ``x_t W_g`` in float32, the
probabilities ``p_t = softmax(x_t W_g)`` over E experts, keeps the k largest
(``G(x_t)``) and weights them

* ``renormalized`` (the paper, Eq. 3): ``w_i = p_i / detach(sum_{j in G} p_j)``
* ``raw`` (the authors' released code): ``w_i = p_i``.

The module also returns the two auxiliary losses of the paper (Sec. 3.3), over
the non-padding tokens only:

* load balancing ``L_a = E * sum_i f_i P_i`` with ``f_i`` the share of the
  (token, slot) assignments that go to expert i and ``P_i`` the mean router
  probability of expert i;
* router z-loss ``L_z = mean_t (logsumexp_i logit_{t,i})^2``.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATE_WEIGHTS = ("renormalized", "raw")


@dataclass
class Routing:
    """The routing decision for N tokens.

    experts: (N, k) int64, the selected experts of each token, most probable first.
    weights: (N, k) gate weights in the input's dtype.
    load_balancing_loss: scalar L_a; router_z_loss: scalar L_z (float32).
    expert_load: (E,) float32, (token, slot) assignments per expert, padding excluded.
    """

    experts: Tensor
    weights: Tensor
    load_balancing_loss: Tensor
    router_z_loss: Tensor
    expert_load: Tensor


class TopKRouter(nn.Module):
    """Routes each of N tokens (N, embed_dim) to ``top_k`` of ``num_experts`` experts."""

    def __init__(self, embed_dim: int, num_experts: int, top_k: int, gate_weights: str = "renormalized"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts, got top_k={top_k}, num_experts={num_experts}")
        if gate_weights not in GATE_WEIGHTS:
            raise ValueError(f"gate_weights must be one of {GATE_WEIGHTS}, got {gate_weights!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate_weights = gate_weights
        self.weight = nn.Parameter(torch.empty(num_experts, embed_dim))  # W_g, stored like nn.Linear
        nn.init.normal_(self.weight, std=embed_dim ** -0.5)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Routing:
        """x: (N, embed_dim); padding_mask: (N,) bool, True where the token is padding."""
        logits = F.linear(x.float(), self.weight.float())  # (N, E), float32 as in the paper's code
        probs = logits.softmax(dim=-1)
        top_probs, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.gate_weights == "renormalized":
            weights = top_probs / top_probs.sum(dim=-1, keepdim=True).detach()
        else:
            weights = top_probs
        keep = None if padding_mask is None else (~padding_mask).to(probs.dtype)
        l_a, load = load_balancing_loss(probs, experts, keep)
        l_z = router_z_loss(logits, keep)
        return Routing(experts, weights.to(x.dtype), l_a, l_z, load)


def _token_count(probs: Tensor, keep: Optional[Tensor]) -> Tensor:
    if keep is None:
        return probs.new_tensor(float(probs.size(0))).clamp(min=1.0)
    return keep.sum().clamp(min=1.0)


def load_balancing_loss(probs: Tensor, experts: Tensor, keep: Optional[Tensor] = None):
    """``L_a = E * sum_i f_i P_i`` (paper Eq. 6) and the per-expert assignment counts.

    probs: (N, E) router probabilities; experts: (N, k) selected experts;
    keep: (N,) 1.0 for real tokens, 0.0 for padding (None: all real).
    Returns (L_a scalar, load (E,)). No host synchronisation.
    """
    num_tokens, num_experts = probs.shape
    k = experts.size(1)
    n = _token_count(probs, keep)
    slot_weight = torch.ones_like(experts, dtype=probs.dtype) if keep is None else keep[:, None].expand(-1, k)
    load = probs.new_zeros(num_experts).scatter_add_(0, experts.reshape(-1), slot_weight.reshape(-1))
    f = load / (n * k)
    mean_prob = (probs if keep is None else probs * keep[:, None]).sum(dim=0) / n
    return num_experts * (f * mean_prob).sum(), load


def router_z_loss(logits: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """``L_z = mean_t (logsumexp_i logit_{t,i})^2`` over non-padding tokens (paper Eq. 7)."""
    z = torch.logsumexp(logits, dim=-1).square()
    if keep is None:
        return z.mean() if z.numel() else z.sum()
    return (z * keep).sum() / _token_count(logits, keep)
