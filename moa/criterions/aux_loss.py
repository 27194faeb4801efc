"""The routers' auxiliary losses inside a fairseq criterion, for MoA and MoH modules alike.

Total loss per token: ``L_task + sum over MoA modules of (alpha L_a + beta L_z)`` (MoA, Sec. 3.3)
``+ moh_beta * mean over MoH modules of L_b`` (MoH, Sec. 3.3: beta = 0.01, averaged over layers as
the authors' code does). fairseq sums the task loss over the batch and divides the gradient by
``sample_size``, so the auxiliary part is added as ``sample_size * (...)``: after the division its
weights on the per-token loss are exactly alpha, beta and moh_beta. The authors' MoA code adds its
part unscaled, weakening it by the batch's token count; a model built with ``--moa-aux-loss-scale
per-batch`` (or ``--moa-released-code``) gets that.

The model hands its routing decisions over explicitly: ``model.pop_named_routings()``
(:class:`~moa.models.routed_transformer.RoutedModel`). With ``--log-routing-by-module`` the
criterion also logs each module's figures as ``routing/TYPE.LAYER/FIGURE`` (``load_cv``, ``la``,
``lz`` for MoA; ``load_cv``, ``lb``, ``active`` for MoH), which fairseq's ``--tensorboard-logdir``
writes as TensorBoard scalars, grouped under ``routing/``.
"""

import math
from dataclasses import dataclass, field
from typing import List

import torch
from fairseq import metrics
from fairseq.dataclass import FairseqDataclass

from moa.routing import HeadRouting, Routing

LOGGED = {
    "moa_aux": "the auxiliary part training adds to the task loss (MoA's and MoH's terms), base 2 like loss",
    "moa_la": "L_a, mean over MoA modules (1.0 = balanced)",
    "moa_lz": "L_z, mean over MoA modules",
    "moa_load_cv": "coefficient of variation of expert load, mean over MoA modules (0 = balanced)",
    "moh_lb": "L_b, mean over MoH modules",
    "moh_active": "fraction of heads active per token, mean over MoH modules",
    "moh_alpha1": "alpha1 (the shared heads' weight), mean over MoH modules and tokens",
    "moh_load_cv": "coefficient of variation of routed-head load, mean over MoH modules (0 = balanced)",
}


@dataclass
class RoutingLossConfig(FairseqDataclass):
    """The --moa-alpha / --moa-beta / --moh-beta flags every criterion of the plugin adds to its base config."""

    moa_alpha: float = field(default=0.01, metadata={"help": "weight alpha of the load-balancing loss L_a per MoA module"})
    moa_beta: float = field(default=0.001, metadata={"help": "weight beta of the router z-loss L_z per MoA module"})
    moh_beta: float = field(default=0.01, metadata={"help": "weight of the MoH load-balance loss L_b, averaged over "
                                                            "MoH modules"})
    log_routing_by_module: bool = field(default=False, metadata={
        "help": "also log every routed module's load CV and auxiliary losses (routing/TYPE.LAYER/...), "
                "e.g. for --tensorboard-logdir"})


def model_routings(model) -> List:
    """The (module name, routing) decisions ``model`` hands over (none without routed attention)."""
    return model.pop_named_routings() if hasattr(model, "pop_named_routings") else []


def routing_terms(model, sample_size, cfg, logging_output: dict):
    """What a criterion adds after its task loss: :func:`routing_aux_loss` of the model's routings,
    logging their figures, and per module with ``cfg.log_routing_by_module``."""
    named = model_routings(model)
    if getattr(cfg, "log_routing_by_module", False):
        log_module_figures(named, sample_size, logging_output)
    per_batch = getattr(getattr(model, "args", None), "moa_aux_loss_scale", "per-token") == "per-batch"
    return routing_aux_loss([routing for _, routing in named], sample_size, cfg, logging_output,
                            moa_per_batch=per_batch)


def log_module_figures(named, sample_size, logging_output: dict) -> None:
    """``routing/TYPE.LAYER/FIGURE`` for each (module name, routing), times ``sample_size``."""
    from moa.models.routed_transformer import attention_site

    for name, routing in named:
        kind, layer = attention_site(name)
        prefix = f"routing/{kind}.{layer}/"
        if isinstance(routing, Routing):
            figures = {"load_cv": _load_cv(routing.expert_load[None]), "la": routing.load_balancing_loss,
                       "lz": routing.router_z_loss}
        else:
            figures = {"lb": routing.balance_loss, "active": torch.tensor(routing.active_fraction)}
            if routing.head_load.numel() > 1:
                figures["load_cv"] = _load_cv(routing.head_load[None])
        for figure, value in figures.items():
            logging_output[prefix + figure] = value.detach().float() * sample_size


def _load_cv(loads: torch.Tensor) -> torch.Tensor:
    return (loads.std(dim=1, unbiased=False) / loads.mean(dim=1).clamp(min=1e-9)).mean()


def routing_aux_loss(routings: List, sample_size, cfg, logging_output: dict, moa_per_batch: bool = False):
    """``sample_size * (MoA and MoH terms)`` for the routings of one forward; logs their figures
    (multiplied by ``sample_size``, as fairseq's reduction divides by it) into ``logging_output``.
    ``moa_per_batch`` (``--moa-aux-loss-scale per-batch``, the released code) adds the MoA terms
    once, unmultiplied, so that their per-token weight is alpha / sample_size."""
    moa = [r for r in routings if isinstance(r, Routing)]
    moh = [r for r in routings if isinstance(r, HeadRouting)]
    if not moa and not moh:
        return 0.0
    terms, weighted = [], []
    if moa:
        l_a = torch.stack([r.load_balancing_loss for r in moa])
        l_z = torch.stack([r.router_z_loss for r in moa])
        terms += [l_a, l_z]
        moa_term = cfg.moa_alpha * l_a.sum() + cfg.moa_beta * l_z.sum()
        weighted.append(moa_term / max(sample_size, 1) if moa_per_batch else moa_term)
        logging_output["moa_la"] = l_a.detach().mean() * sample_size
        logging_output["moa_lz"] = l_z.detach().mean() * sample_size
        logging_output["moa_load_cv"] = _load_cv(torch.stack([r.expert_load for r in moa])) * sample_size
    if moh:
        l_b = torch.stack([r.balance_loss for r in moh])
        terms += [r.balance_loss for r in moh if r.learned]
        weighted.append(cfg.moh_beta * l_b.mean())
        logging_output["moh_lb"] = l_b.detach().mean() * sample_size
        logging_output["moh_active"] = sum(r.active_fraction for r in moh) / len(moh) * sample_size
        logging_output["moh_alpha1"] = torch.stack([r.mean_alpha_shared for r in moh]).detach().mean() * sample_size
        routed = [r.head_load for r in moh if r.head_load.numel() > 1]
        if routed:
            logging_output["moh_load_cv"] = sum(_load_cv(load[None]) for load in routed) / len(routed) * sample_size
    weighted_terms = (moa and (cfg.moa_alpha or cfg.moa_beta)) or (any(r.learned for r in moh) and cfg.moh_beta)
    if torch.is_grad_enabled() and weighted_terms and not any(t.requires_grad for t in terms):
        raise RuntimeError(
            "the routers' auxiliary losses carry no gradient: the routed layers ran without autograd "
            "(fairseq's own checkpoint_wrapper runs them under no_grad first; the plugin's layers "
            "checkpoint with moa.activation_checkpointing, which keeps it). Build the layers through the "
            "plugin's archs, or set --moa-alpha 0 --moa-beta 0 --moh-beta 0."
        )
    aux = sample_size * sum(weighted)
    logging_output["moa_aux"] = aux.detach()
    return aux


def reduce_routing_metrics(logging_outputs) -> None:
    """Log the sample-size-weighted means of the routing figures that were logged."""
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    if not sample_size:
        return
    per_module = sorted({key for log in logging_outputs for key in log if key.startswith("routing/")})
    for key in [*LOGGED, *per_module]:
        if not any(key in log for log in logging_outputs):
            continue
        total = float(sum(log.get(key, 0) for log in logging_outputs)) / sample_size
        if key == "moa_aux":
            total /= math.log(2)
        metrics.log_scalar(key, total, sample_size, round=4)
