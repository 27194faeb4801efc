"""Routing tokens to attention experts (MoA) and to attention heads (MoH).

MoA (Zhang et al. 2022, Sec. 3.1-3.2): :class:`TopKRouter`.

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

MoH (Jin et al. 2025, Sec. 3.2): :class:`TwoStageHeadRouter`, shared heads always on and top-K of
the routed heads, weighted by a second stage that mixes the two groups (see its docstring); and
:class:`QueryNormHeadRouter`, the parameter-free router of converted models (MoH-LLaMA3).

SwitchHead (Csordas et al. 2024, Sec. 3): :class:`SigmoidTopKRouter`, non-competitive selection of
k of E experts in each of H heads, weighted by the sigmoid scores themselves, no auxiliary loss.
"""

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATE_WEIGHTS = ("renormalized", "raw")
ROUTER_INITS = ("normal", "zeros")
HEAD_GATE_SCALES = ("softmax", "unit")
BALANCE_LOSSES = ("paper", "experts-scaled")
HEAD_ROUTERS = ("learned", "query-norm")


class Routing:
    """What every router returns and every routed module hands to the criterion and the analysis.

    Common to MoA and MoH, for N tokens (flattened time-first) and E experts or routed heads:
    ``selected`` (N, k) int64, the chosen experts/heads, most probable first (None when k = 0);
    ``gates`` (N, k) their gate weights in the input's dtype (None when k = 0); ``load`` (E,) float32,
    (token, slot) assignments per expert, padding excluded; ``probs`` (N, E) float32 router
    probabilities (None when k = 0). In incremental decoding the routers skip what only the criterion
    and the analysis read: ``load``, ``probs`` and the auxiliary losses are then None. ``family`` ("MoA", "MoH") names the method; in lower case it
    prefixes the figures the criterion logs.
    """

    family: ClassVar[str]
    aux_reduction: ClassVar[str] = "sum"  # how the criterion combines the modules' aux_loss: sum or mean
    active_fraction: ClassVar[Optional[float]] = None
    mean_alpha_shared: ClassVar[Optional[Tensor]] = None

    def aux_losses(self) -> Dict[str, Tensor]:
        """The module's auxiliary losses by name (scalars)."""
        raise NotImplementedError

    def aux_loss(self, cfg, sample_size) -> Tensor:
        """This module's auxiliary term, weighted by ``cfg`` (the criterion's --moa-alpha, --moa-beta,
        --moh-beta, --moa-aux-loss-scale), per unit of the task loss's ``sample_size``."""
        raise NotImplementedError

    def trains_router(self, cfg) -> bool:
        """Whether :meth:`aux_loss` under ``cfg`` has a gradient to give the router."""
        raise NotImplementedError

    def figures(self) -> Dict[str, Tensor]:
        """The figures to log for this module, by name (scalars)."""
        figures = dict(self.aux_losses())
        if self.load.numel() > 1:
            figures["load_cv"] = load_cv(self.load)
        return figures


def load_cv(load: Tensor) -> Tensor:
    """Coefficient of variation of a load vector (E,): 0 when balanced."""
    return load.std(unbiased=False) / load.mean().clamp(min=1e-9)


@dataclass
class ExpertRouting(Routing):
    """MoA's routing decision (:class:`TopKRouter`): ``selected``/``gates``/``load``/``probs`` as in
    :class:`Routing` (k >= 1 always), ``load_balancing_loss`` L_a and ``router_z_loss`` L_z (float32)."""

    family: ClassVar[str] = "MoA"

    selected: Tensor
    gates: Tensor
    load: Optional[Tensor]
    probs: Optional[Tensor]
    load_balancing_loss: Optional[Tensor]
    router_z_loss: Optional[Tensor]

    def aux_losses(self) -> Dict[str, Tensor]:
        return {"la": self.load_balancing_loss, "lz": self.router_z_loss}

    def aux_loss(self, cfg, sample_size) -> Tensor:
        """``alpha L_a + beta L_z`` (MoA, Sec. 3.3); with ``--moa-aux-loss-scale per-batch`` (the released
        code) added once to the batch's summed loss, i.e. divided by ``sample_size`` here."""
        term = cfg.moa_alpha * self.load_balancing_loss + cfg.moa_beta * self.router_z_loss
        return term / max(sample_size, 1) if cfg.moa_aux_loss_scale == "per-batch" else term

    def trains_router(self, cfg) -> bool:
        return bool(cfg.moa_alpha or cfg.moa_beta)


class TopKRouter(nn.Module):
    """Routes each of N tokens (N, embed_dim) to ``top_k`` of ``num_experts`` experts."""

    def __init__(self, embed_dim: int, num_experts: int, top_k: int, gate_weights: str = "renormalized",
                 init: str = "normal"):
        # logits in float32 at least, see router_dtype
        super().__init__()
        if init not in ROUTER_INITS:
            raise ValueError(f"init must be one of {ROUTER_INITS}, got {init!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts, got top_k={top_k}, num_experts={num_experts}")
        if gate_weights not in GATE_WEIGHTS:
            raise ValueError(f"gate_weights must be one of {GATE_WEIGHTS}, got {gate_weights!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate_weights = gate_weights
        self.init = init
        self.weight = nn.Parameter(torch.empty(num_experts, embed_dim))  # W_g, stored like nn.Linear
        self.reset_parameters()

    def reset_parameters(self, std: Optional[float] = None) -> None:
        """``normal``: W_g ~ N(0, std^2), std = d_model^-1/2 unless given; ``zeros``: W_g = 0, so every
        token starts with uniform routing (and the same k experts), as the authors' released code does."""
        if self.init == "zeros":
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, std=self.weight.size(1) ** -0.5 if std is None else std)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None, aux: bool = True) -> ExpertRouting:
        """x: (N, embed_dim); padding_mask: (N,) bool, True where the token is padding; ``aux=False``
        (incremental decoding) skips the load and the auxiliary losses."""
        logits = router_linear(x, self.weight)  # (N, E)
        probs = logits.softmax(dim=-1)
        top_probs, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.gate_weights == "renormalized":
            weights = top_probs / top_probs.sum(dim=-1, keepdim=True).detach()
        else:
            weights = top_probs
        if not aux:
            return ExpertRouting(experts, weights.to(x.dtype), None, None, None, None)
        keep = None if padding_mask is None else (~padding_mask).to(probs.dtype)
        l_a, load = load_balancing_loss(probs, experts, keep)
        l_z = router_z_loss(logits, keep)
        return ExpertRouting(experts, weights.to(x.dtype), load, probs, l_a, l_z)


def router_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Router logits ``x W^T`` in :func:`router_dtype`, also under autocast (which would run the
    matmul in bf16/fp16 whatever its inputs' dtype)."""
    dtype = router_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dtype), weight.to(dtype))


def router_dtype(x: Tensor) -> torch.dtype:
    """Router logits and softmax run in float32 (as in both papers' code) or wider: float64 inputs
    keep float64, so that tests can compare with references exactly."""
    return torch.promote_types(x.dtype, torch.float32)


def _token_count(probs: Tensor, keep: Optional[Tensor]) -> Union[Tensor, float]:
    """The real tokens, at least 1: a Python number when none is padding (a tensor made from it would be a
    host-to-device copy on a GPU), else counted on the device."""
    if keep is None:
        return float(max(probs.size(0), 1))
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


@dataclass
class HeadRouting(Routing):
    """MoH's routing decision over h = h_s shared + E routed heads: ``selected``/``gates``/``load``/
    ``probs`` as in :class:`Routing`, over the routed heads (0..E-1; None when K = 0), and
    ``shared_gates`` (N, h_s) the shared heads' gates (None when h_s = 0); ``balance_loss`` L_b
    (float32); ``mean_alpha_shared`` the mean alpha1 over real tokens; ``active_fraction`` (h_s + K) / h;
    ``learned``: False for :class:`QueryNormHeadRouter`, whose L_b is a constant 0. The criterion
    averages L_b over the MoH modules, as the authors' code does.
    """

    family: ClassVar[str] = "MoH"
    aux_reduction: ClassVar[str] = "mean"

    selected: Optional[Tensor]
    gates: Optional[Tensor]
    load: Optional[Tensor]
    probs: Optional[Tensor]
    shared_gates: Optional[Tensor]
    balance_loss: Optional[Tensor]
    mean_alpha_shared: Optional[Tensor]
    active_fraction: float
    learned: bool = True

    def aux_losses(self) -> Dict[str, Tensor]:
        return {"lb": self.balance_loss}

    def aux_loss(self, cfg, sample_size) -> Tensor:
        """``moh_beta L_b`` (MoH, Sec. 3.3)."""
        return cfg.moh_beta * self.balance_loss

    def trains_router(self, cfg) -> bool:
        return self.learned and bool(cfg.moh_beta)

    def figures(self) -> Dict[str, Tensor]:
        return {**super().figures(), "active": self.mean_alpha_shared.new_full((), self.active_fraction),
                "alpha1": self.mean_alpha_shared.detach()}


def check_head_counts(num_heads: int, shared_heads: int, top_k: int) -> int:
    """The number of routed heads, E = num_heads - shared_heads, after checking that 0 <= h_s <= h
    and 0 <= K <= E (K = 0: the shared heads only, an inference setting when E > 0; see
    :meth:`~moa.moh_attention.MixtureOfHeadsAttention.route`)."""
    routed = num_heads - shared_heads
    if not 0 <= shared_heads <= num_heads:
        raise ValueError(f"shared_heads must be between 0 and num_heads={num_heads}, got {shared_heads}")
    if not 0 <= top_k <= routed:
        raise ValueError(f"top_k must be between 0 and the {routed} routed heads, got {top_k}")
    if not shared_heads and not top_k:
        raise ValueError(f"top_k must be at least 1 when no head is shared (all {num_heads} routed), got 0")
    return routed


class TwoStageHeadRouter(nn.Module):
    """MoH's router for a module of ``num_heads`` heads, the first ``shared_heads`` always active.

    From the query token x_t, with W_s (h_s x d), W_r (E x d), W_h (2 x d), no biases, float32:
    ``[alpha1, alpha2] = softmax(W_h x_t)``; shared head i gets ``alpha1 softmax(W_s x_t)_i``;
    the top-K routed heads by ``p = softmax(W_r x_t)`` get ``alpha2 p_i``, the others 0 (paper,
    Eq. 5-6: ``gate_scale="softmax"``). ``gate_scale="unit"`` is the released code's scaling:
    routed gates ``2 alpha2 K p_i / sum_{j in TopK} p_j`` (the denominator not detached), shared
    gates ``2 alpha1 h_s softmax(W_s x_t)_i``, so uniform routers give every active head a gate of
    exactly 1 and the module equals multi-head attention over the active heads. With only one group
    (h_s = 0 or E = 0) there is no W_h and no alpha (the factor 2 goes too). K can be set below
    (even to 0) or above the K a model was trained with: the gates of the heads that stay active
    are unchanged, the others' terms are dropped (the inference-time compute dial).

    Load balance over the routed heads and non-padding tokens, with ``P_i`` the mean of p_i and
    ``f_i`` the share of tokens that select head i (sum_i f_i = K): ``L_b = sum_i P_i f_i``
    (``balance_loss="paper"``, Eq. 7) or ``E sum_i P_i f_i`` (``"experts-scaled"``, the released
    code: K at uniform routing).
    """

    def __init__(self, embed_dim: int, num_heads: int, shared_heads: int, top_k: int,
                 gate_scale: str = "softmax", balance_loss: str = "paper"):
        super().__init__()
        routed = check_head_counts(num_heads, shared_heads, top_k)
        if gate_scale not in HEAD_GATE_SCALES:
            raise ValueError(f"gate_scale must be one of {HEAD_GATE_SCALES}, got {gate_scale!r}")
        if balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"balance_loss must be one of {BALANCE_LOSSES}, got {balance_loss!r}")
        self.num_heads, self.shared_heads, self.routed_heads, self.top_k = num_heads, shared_heads, routed, top_k
        self.gate_scale, self.balance_loss = gate_scale, balance_loss
        self.shared = nn.Linear(embed_dim, shared_heads, bias=False) if shared_heads else None  # W_s
        self.routed = nn.Linear(embed_dim, routed, bias=False) if routed else None  # W_r
        self.mix = nn.Linear(embed_dim, 2, bias=False) if shared_heads and routed else None  # W_h
        for linear in (self.shared, self.routed, self.mix):
            if linear is not None:
                nn.init.normal_(linear.weight, std=embed_dim ** -0.5)

    @property
    def active_fraction(self) -> float:
        return (self.shared_heads + self.top_k) / self.num_heads

    needs_routed_queries = False

    def _logits(self, x32: Tensor) -> Dict[str, Tensor]:
        """The logits of W_s, W_r (when K > 0) and W_h, from one matmul over the stacked weights."""
        layers = {name: layer for name, layer in (("shared", self.shared), ("routed", self.routed), ("mix", self.mix))
                  if layer is not None and (name != "routed" or self.top_k)}
        weights = [layer.weight for layer in layers.values()]
        logits = router_linear(x32, weights[0] if len(weights) == 1 else torch.cat(weights))
        return dict(zip(layers, logits.split([w.size(0) for w in weights], dim=-1)))

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None,
                routed_queries: Optional[Tensor] = None, aux: bool = True) -> HeadRouting:
        """x: (N, embed_dim); padding_mask: (N,) bool, True where the token is padding;
        routed_queries: unused (the signature is :class:`QueryNormHeadRouter`'s); ``aux=False``
        (incremental decoding) skips the load, L_b and the mean alpha1."""
        x32 = x.to(router_dtype(x))
        unit = self.gate_scale == "unit"
        keep = None if padding_mask is None else (~padding_mask).to(x32.dtype)
        shared = routed = heads = probs = None
        balance = load = mean_alpha = None
        logits = self._logits(x32)
        if self.shared is not None:
            shared = logits["shared"].softmax(dim=-1)
            if unit:
                shared = shared * self.shared_heads
        if self.top_k:
            probs = logits["routed"].softmax(dim=-1)  # (N, E)
            top_probs, heads = probs.topk(self.top_k, dim=-1)
            routed = self.top_k * top_probs / top_probs.sum(dim=-1, keepdim=True).clamp(min=1e-9) if unit \
                else top_probs
            if aux:
                l_a, load = load_balancing_loss(probs, heads, keep)  # E sum P f with sum f = 1
                balance = l_a * self.top_k * (1.0 if self.balance_loss == "experts-scaled" else 1.0 / self.routed_heads)
        if self.mix is not None:
            alphas = logits["mix"].softmax(dim=-1)  # (N, 2)
            alpha_shared = alphas[:, 0]
            if unit:
                alphas = 2 * alphas
            shared = shared * alphas[:, :1]
            routed = None if routed is None else routed * alphas[:, 1:]
        else:
            alpha_shared = x32.new_full((x32.size(0),), 1.0 if self.shared_heads else 0.0)
        if aux:
            balance = x32.new_zeros(()) if balance is None else balance
            load = x32.new_zeros(self.routed_heads) if load is None else load
            mean_alpha = (alpha_shared if keep is None else alpha_shared * keep).sum() / _token_count(x32, keep)
        else:
            probs = None
        cast = (lambda g: None if g is None else g.to(x.dtype))
        return HeadRouting(heads, cast(routed), load, probs, cast(shared), balance, mean_alpha, self.active_fraction)


class QueryNormHeadRouter(nn.Module):
    """The parameter-free router of a converted model (MoH paper, Sec. 4: MoH-LLaMA3).

    A routed head's score for token t is the L2 norm of its query, ``s_i = ||q_{t,i}||_2`` (before
    the 1/sqrt(D) scaling); the top-K routed heads by score are active. Gates are quantised: 1 for
    every shared head and every selected routed head in the forward pass. Their gradient comes from
    a straight-through estimator ``g_i = 1 + p_i - detach(p_i)`` with ``p = softmax(s / mean_j s_j)``
    over the routed heads, so the loss reaches the query projection through the selection too (the
    released code has no estimator: its mask has no gradient). The estimator acts on the selected
    heads only, as the heads not selected are not computed.

    The released code divides the scores by their per-token standard deviation before its softmax;
    with E = 2 that makes p constant (the two normalised scores are always sqrt(2) apart) and the
    estimator would carry nothing, so p divides by the mean norm: the ranking, hence the forward
    pass, is the same, and p is again independent of the queries' overall scale. No L_b
    (``balance_loss`` is 0); the load is still measured.
    """

    def __init__(self, num_heads: int, shared_heads: int, top_k: int):
        super().__init__()
        self.routed_heads = check_head_counts(num_heads, shared_heads, top_k)
        self.num_heads, self.shared_heads, self.top_k = num_heads, shared_heads, top_k

    @property
    def active_fraction(self) -> float:
        return (self.shared_heads + self.top_k) / self.num_heads

    needs_routed_queries = True  # the module projects them once, for the router and for attention

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None,
                routed_queries: Optional[Tensor] = None, aux: bool = True) -> HeadRouting:
        """x: (N, embed_dim) the query tokens; padding_mask: (N,) bool, True at padding;
        routed_queries: (N, E, D) the routed heads' queries (None when E = 0); ``aux=False``
        (incremental decoding) skips the load and the estimator's probabilities."""
        dtype, device = x.dtype, x.device
        shared = torch.ones(x.size(0), self.shared_heads, dtype=dtype, device=device) if self.shared_heads else None
        heads = routed = probs = None
        load = torch.zeros(self.routed_heads, device=device) if aux else None
        if self.top_k:
            scores = routed_queries.to(router_dtype(routed_queries)).norm(dim=-1)  # (N, E)
            probs = (scores / scores.mean(dim=-1, keepdim=True).clamp(min=1e-9)).softmax(dim=-1)
            top_probs, heads = probs.topk(self.top_k, dim=-1)
            routed = (1.0 + (top_probs - top_probs.detach())).to(dtype)  # exactly 1 forward
            if aux:
                keep = None if padding_mask is None else (~padding_mask).to(probs.dtype)
                load = load_balancing_loss(probs, heads, keep)[1]
            else:
                probs = None
        if not aux:
            return HeadRouting(heads, routed, None, None, shared, None, None, self.active_fraction, learned=False)
        alpha = torch.full((), 1.0 if self.shared_heads else 0.0, device=device)
        return HeadRouting(heads, routed, load, probs, shared, torch.zeros((), device=device), alpha,
                           self.active_fraction, learned=False)


@dataclass
class SwitchHeadRouting(Routing):
    """SwitchHead's selection of one projection (:class:`SigmoidTopKRouter`) over H heads of E experts:
    ``selected`` (N, H * k) the experts, numbered ``h * E + e`` (expert e of head h), head by head;
    ``gates`` (N, H * k) their sigmoid scores; ``load`` (H * E,) assignments per expert, padding
    excluded; ``probs`` (N, H * E) every sigmoid score. No auxiliary loss (the paper has none): the
    criterion adds nothing and logs the load's coefficient of variation."""

    family: ClassVar[str] = "SwitchHead"

    selected: Tensor
    gates: Tensor
    load: Optional[Tensor]
    probs: Optional[Tensor]

    def aux_losses(self) -> Dict[str, Tensor]:
        return {}

    def aux_loss(self, cfg, sample_size) -> Tensor:
        return self.gates.new_zeros((), dtype=torch.float32)

    def trains_router(self, cfg) -> bool:
        return False


class SigmoidTopKRouter(nn.Module):
    """Routes each of N tokens to ``top_k`` of ``num_experts`` experts in each of ``num_heads`` heads.

    Scores ``s = sigmoid(x W_sel^T)`` in float32, W_sel (H * E, d) with row ``h * E + e`` for expert e
    of head h (the released layer's ``sel_v`` / ``sel_o``); in each head the k highest scores are kept
    and are the gates themselves: no softmax over experts, no renormalisation (SwitchHead, Eq. 8-9).
    ``expert_dropout`` (the released code's, in training only): each score is left out of the top-k
    choice with that probability; a kept expert's gate is still its score. Initialised as the
    released layer: N(0, 1/d), then rows rescaled by :func:`renorm_rows_`."""

    def __init__(self, embed_dim: int, num_heads: int, num_experts: int, top_k: int, expert_dropout: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts, got top_k={top_k}, num_experts={num_experts}")
        if not 0.0 <= expert_dropout < 1.0:
            raise ValueError(f"expert_dropout must be in [0, 1), got {expert_dropout}")
        self.num_heads, self.num_experts, self.top_k, self.expert_dropout = num_heads, num_experts, top_k, expert_dropout
        self.weight = nn.Parameter(torch.empty(num_heads * num_experts, embed_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.size(1) ** -0.5)
        renorm_rows_(self.weight)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None, aux: bool = True) -> SwitchHeadRouting:
        """x: (N, embed_dim); padding_mask: (N,) bool, True at padding (excluded from the load);
        ``aux=False`` (incremental decoding) skips the load and the scores."""
        scores = router_linear(x, self.weight).view(x.size(0), self.num_heads, self.num_experts).sigmoid()
        with torch.no_grad():
            eligible = scores
            if self.expert_dropout and self.training:
                eligible = scores.masked_fill(torch.rand_like(scores) < self.expert_dropout, float("-inf"))
            experts = eligible.topk(self.top_k, dim=-1).indices  # (N, H, k)
        gates = scores.gather(-1, experts).flatten(1)
        offsets = torch.arange(self.num_heads, device=x.device).view(1, -1, 1) * self.num_experts
        selected = (experts + offsets).flatten(1)  # (N, H * k), h * E + e
        if not aux:
            return SwitchHeadRouting(selected, gates.to(x.dtype), None, None)
        weight = torch.ones_like(selected, dtype=scores.dtype)
        if padding_mask is not None:
            weight = weight * (~padding_mask).to(scores.dtype)[:, None]
        load = scores.new_zeros(self.num_heads * self.num_experts).scatter_add_(0, selected.reshape(-1),
                                                                                weight.reshape(-1))
        return SwitchHeadRouting(selected, gates.to(x.dtype), load, scores.flatten(1))


def renorm_rows_(weight: Tensor) -> None:
    """Divide every row of ``weight`` by its norm, then multiply it by its former standard deviation over
    that of the normalised matrix (the released SwitchHead's ``renorm_rows``)."""
    std = weight.std(dim=-1, keepdim=True)
    weight.div_(weight.norm(dim=-1, keepdim=True))
    weight.mul_(std / weight.std())
