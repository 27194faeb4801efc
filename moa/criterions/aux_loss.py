"""MoA's auxiliary losses inside a fairseq criterion (paper Sec. 3.3).

Total loss per token: ``L_task + sum over MoA modules of (alpha L_a + beta L_z)``.
fairseq sums the task loss over the batch and divides the gradient by
``sample_size``, so the auxiliary part is added as ``sample_size * (...)``:
after the division its weight on the per-token loss is exactly alpha and beta
(the authors' code adds it unscaled, weakening it by the batch's token count).
"""

import math
from dataclasses import dataclass, field
from typing import List

import torch
from fairseq import metrics
from fairseq.dataclass import FairseqDataclass

from moa.attention import MixtureOfAttentionHeads
from moa.routing import Routing

LOGGED = {
    "moa_aux": "the auxiliary part training adds to the task loss, base 2 like loss",
    "moa_la": "L_a, mean over MoA modules (1.0 = balanced)",
    "moa_lz": "L_z, mean over MoA modules",
    "moa_load_cv": "coefficient of variation of expert load, mean over modules (0 = balanced)",
}


@dataclass
class MoAAuxLossConfig(FairseqDataclass):
    """The --moa-alpha / --moa-beta flags every MoA criterion adds to its base config."""

    moa_alpha: float = field(default=0.01, metadata={"help": "weight alpha of the load-balancing loss L_a per MoA module"})
    moa_beta: float = field(default=0.001, metadata={"help": "weight beta of the router z-loss L_z per MoA module"})


def pop_routings(model) -> List[Routing]:
    """The routings recorded by every MoA module since the last call, clearing them."""
    routings = []
    for module in model.modules():
        if isinstance(module, MixtureOfAttentionHeads) and module.routing is not None:
            routings.append(module.routing)
            module.routing = None
    return routings


def moa_aux_loss(routings: List[Routing], sample_size, alpha: float, beta: float, logging_output: dict):
    """``sample_size * sum_modules(alpha L_a + beta L_z)``; adds the MoA figures to ``logging_output``."""
    if not routings:
        return 0.0
    l_a = torch.stack([r.load_balancing_loss for r in routings])
    l_z = torch.stack([r.router_z_loss for r in routings])
    if torch.is_grad_enabled() and (alpha or beta) and not (l_a.requires_grad or l_z.requires_grad):
        raise RuntimeError(
            "the MoA auxiliary losses carry no gradient: the layers ran without autograd "
            "(fairseq's --checkpoint-activations runs them under no_grad first). Train without "
            "--checkpoint-activations, or set --moa-alpha 0 --moa-beta 0."
        )
    loads = torch.stack([r.expert_load for r in routings])
    load_cv = loads.std(dim=1, unbiased=False) / loads.mean(dim=1).clamp(min=1e-9)
    aux = sample_size * (alpha * l_a.sum() + beta * l_z.sum())
    logging_output["moa_aux"] = aux.detach()
    logging_output["moa_la"] = l_a.detach().mean() * sample_size
    logging_output["moa_lz"] = l_z.detach().mean() * sample_size
    logging_output["moa_load_cv"] = load_cv.mean() * sample_size
    return aux


def reduce_moa_metrics(logging_outputs) -> None:
    """Log the sample-size-weighted means of the MoA figures."""
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    if not sample_size or not any("moa_la" in log for log in logging_outputs):
        return
    for key in LOGGED:
        total = float(sum(log.get(key, 0) for log in logging_outputs)) / sample_size
        if key == "moa_aux":
            total /= math.log(2)
        metrics.log_scalar(key, total, sample_size, round=4)
