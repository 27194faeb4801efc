"""What the routers of a trained model do, measured teacher-forced over a subset (``moa-analyze``).

Per routed module (MoA: experts; MoH: routed heads), over the non-padding query tokens:

* load: the share of the (token, slot) assignments each expert receives (1/E each when balanced);
* router entropy ``-sum_i p_i log p_i``, mean over tokens (log E for a uniform router);
* the mean gate weight of each token's top choice; for MoH also the active-head fraction and the
  mean alpha1 / alpha2 (the shared and routed heads' stage-two weights);
* the share of tokens whose top choice differs from the previous layer's (same attention type);
* specialisation, as the MoA paper's table: for each expert the tokens with the highest pointwise
  mutual information ``PMI(t, e) = log p(e | t) / p(e)`` with being routed to it, p over the
  (token, slot) assignments, among tokens seen at least ``min_count`` times.

Head similarity, as the MoH paper measures it, for every attention module (MoA: between its
experts, all computed; MoH and fairseq's multi-head attention: between heads), mean over head pairs
and non-padding query tokens: attention-pattern similarity ``1 - 0.5 ||A_i - A_j||_1`` (1 for equal
patterns, 0 for disjoint ones) and the cosine similarity of the heads' contributions to the
module's output, ``A_i V_i W_O^i`` (in d_model, so that heads with separate value projections and
MoA's experts over one shared value head compare on the same footing).
"""

import functools
import math
from collections import defaultdict
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention

from moa.moh_attention import multihead_outputs
from moa.routed_attention import RoutedAttention


class ModuleRouting:
    """The routing figures of one routed module, accumulated batch by batch."""

    def __init__(self, name: str, kind: str, layer: int, family: str, num_experts: int, top_k: int,
                 active_fraction: Optional[float] = None):
        self.name, self.kind, self.layer, self.family = name, kind, layer, family
        self.num_experts, self.top_k, self.active_fraction = num_experts, top_k, active_fraction
        self.load = torch.zeros(num_experts, dtype=torch.float64)
        self.tokens = 0
        self.entropy_sum = self.top_weight_sum = self.alpha1_sum = 0.0
        self.token_ids: List[torch.Tensor] = []
        self.assignments: List[torch.Tensor] = []

    def add(self, experts, probs, top_weight, keep, token_ids, alpha1_mean=None) -> None:
        """experts: (N, k) selected experts, most probable first; probs: (N, E) router
        probabilities; top_weight: (N,) gate weight of the top choice; keep: (N,) bool, False at
        padding; token_ids: (N,) the query tokens; alpha1_mean: MoH's mean alpha1 over the kept tokens."""
        keep = keep.bool()
        experts, probs, top_weight, token_ids = experts[keep], probs[keep].double(), top_weight[keep], token_ids[keep]
        n = experts.size(0)
        self.load += torch.bincount(experts.reshape(-1), minlength=self.num_experts).double()
        self.entropy_sum += float(-(probs * probs.clamp(min=1e-30).log()).sum())
        self.top_weight_sum += float(top_weight.double().sum())
        if alpha1_mean is not None:
            self.alpha1_sum += float(alpha1_mean) * n
        self.tokens += n
        self.token_ids.append(token_ids.cpu())
        self.assignments.append(experts.cpu())

    @property
    def top_choices(self) -> torch.Tensor:
        return torch.cat([a[:, 0] for a in self.assignments]) if self.assignments else torch.zeros(0, dtype=torch.long)

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        figures = {"name": self.name, "type": self.kind, "layer": self.layer, "family": self.family,
                   "experts": self.num_experts, "top_k": self.top_k, "tokens": self.tokens,
                   "load": (self.load / self.load.sum().clamp(min=1)).tolist(),
                   "router_entropy": self.entropy_sum / n, "max_entropy": math.log(self.num_experts),
                   "top_gate_weight": self.top_weight_sum / n}
        if self.active_fraction is not None:  # MoH
            figures.update(active_fraction=self.active_fraction, alpha1=self.alpha1_sum / n,
                           alpha2=1.0 - self.alpha1_sum / n)
        return figures

    def specialisation(self, min_count: int, top: int) -> Dict[int, list]:
        """expert -> [(token id, PMI, assignments of that token to the expert, its occurrences)]."""
        tokens = torch.cat(self.token_ids)
        assignments = torch.cat(self.assignments)
        return pmi_table(tokens, assignments, self.num_experts, min_count, top)


def pmi_table(tokens: torch.Tensor, assignments: torch.Tensor, num_experts: int, min_count: int,
              top: int) -> Dict[int, list]:
    """tokens: (M,) query token ids; assignments: (M, k) their experts. For each expert, the ``top``
    tokens with the highest PMI with it (ties: more assignments first), tokens seen fewer than
    ``min_count`` times skipped."""
    k = assignments.size(1)
    vocab = int(tokens.max()) + 1 if tokens.numel() else 1
    pairs = torch.bincount((tokens[:, None] * num_experts + assignments).reshape(-1),
                           minlength=vocab * num_experts).view(vocab, num_experts).double()
    occurrences = torch.bincount(tokens, minlength=vocab).double()
    p_expert = pairs.sum(dim=0) / max(tokens.numel() * k, 1)
    p_given = pairs / (occurrences[:, None] * k).clamp(min=1)
    pmi = (p_given / p_expert.clamp(min=1e-30)).clamp(min=1e-30).log()
    table = {}
    for e in range(num_experts):
        rows = [(int(t), float(pmi[t, e]), int(pairs[t, e]), int(occurrences[t]))
                for t in torch.nonzero((pairs[:, e] > 0) & (occurrences >= min_count)).flatten().tolist()]
        table[e] = sorted(rows, key=lambda r: (-r[1], -r[2], r[0]))[:top]
    return table


def top_choice_changes(modules: List[ModuleRouting]) -> Dict[str, float]:
    """module name -> share of tokens whose top choice differs from the previous layer's module of
    the same attention type (the first layer of a type has none)."""
    changes = {}
    by_kind = defaultdict(list)
    for m in modules:
        by_kind[m.kind].append(m)
    for stack in by_kind.values():
        stack.sort(key=lambda m: m.layer)
        for previous, current in zip(stack, stack[1:]):
            a, b = previous.top_choices, current.top_choices
            if a.numel() and a.numel() == b.numel():
                changes[current.name] = float((a != b).double().mean())
    return changes


class HeadSimilarity:
    """Head similarity of one attention module, accumulated batch by batch."""

    def __init__(self, name: str, kind: str, layer: int):
        self.name, self.kind, self.layer, self.heads = name, kind, layer, 0
        self.attention_sum = self.output_sum = 0.0
        self.count = 0

    def add(self, attention: torch.Tensor, outputs: torch.Tensor, keep: torch.Tensor) -> None:
        """attention: (B, H, T, S) every head's probabilities; outputs: (B, H, T, C) every head's
        ``A_i V_i W_O^i``; keep: (B, T) bool, False at padded queries."""
        heads = self.heads = attention.size(1)
        i, j = torch.triu_indices(heads, heads, offset=1)
        if not i.numel():
            return
        keep = keep.bool()[:, None, :]  # (B, 1, T)
        similarity = 1.0 - 0.5 * (attention[:, i] - attention[:, j]).abs().sum(dim=-1)  # (B, pairs, T)
        cosine = F.cosine_similarity(outputs[:, i], outputs[:, j], dim=-1)
        mask = keep.expand_as(similarity)
        self.attention_sum += float(similarity[mask].double().sum())
        self.output_sum += float(cosine[mask].double().sum())
        self.count += int(mask.sum())

    def summary(self) -> dict:
        n = max(self.count, 1)
        return {"name": self.name, "type": self.kind, "layer": self.layer, "heads": self.heads,
                "attention_similarity": self.attention_sum / n, "output_cosine": self.output_sum / n}


@functools.singledispatch
def head_outputs(module, query, key, key_padding_mask=None, attn_mask=None):
    """(A, O): every head's (MoA: every expert's) attention probabilities (B, H, T, S) and contributions
    to the output ``A_i V_i W_O^i`` (B, H, T, C), recomputed from the module's weights. query: (T, B, C);
    key: (S, B, C_k). The routed modules say it themselves (``RoutedAttention.head_outputs``);
    fairseq's ``MultiheadAttention`` has the parameters of MoH's heads (:func:`multihead_outputs`)."""
    raise TypeError(f"{type(module).__name__} is not an attention module moa-analyze knows")


head_outputs.register(MultiheadAttention, multihead_outputs)
head_outputs.register(RoutedAttention, lambda module, *args: module.head_outputs(*args))


class evaluation_batches:
    """The batches of one pass over ``dataset``, in fairseq's order (``task.get_batch_iterator``, no
    shuffling), collated in this process. fairseq's iterator would load them through a DataLoader built
    with ``pin_memory=True`` whatever the device, which torch warns about where no accelerator is; an
    evaluation pass needs neither workers nor pinned memory."""

    def __init__(self, task, dataset, max_tokens: int):
        self.dataset = dataset
        self.batches = task.get_batch_iterator(dataset, max_tokens=max_tokens,
                                               required_batch_size_multiple=1).frozen_batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for indices in self.batches:
            yield self.dataset.collater([self.dataset[i] for i in indices])


def analyze(checkpoint: str, data_bin: str, subset: str, max_tokens: int = 4096, label: str = "",
            progress: bool = True) -> dict:
    """Run ``checkpoint`` teacher-forced over ``subset`` of ``data_bin`` and measure it: a dict with
    arch, family (MoA, MoH or Transformer), ``modules`` (:class:`ModuleRouting`), ``similarity``
    (:class:`HeadSimilarity`) and the source and target dictionaries."""
    import sys

    from fairseq import checkpoint_utils
    from tqdm import tqdm

    from moa.models.routed_transformer import attention_site, pop_named_routings

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data_bin})
    model = models[0].eval()
    unread = {type(m).__name__ for m in model.modules() if isinstance(m, RoutedAttention) and m.active_heads()[0]
              not in ("MoA", "MoH")}
    if unread:
        from moa_tools import ToolError

        raise ToolError(f"{checkpoint}: {', '.join(sorted(unread))} is not analysed: moa-analyze reads MoA's and MoH's "
                        "routers, whose scores are distributions; SwitchHead's sigmoid scores are not (its load is "
                        "logged in training as switchhead_load_cv)")
    task.load_dataset(subset)
    source, target = task.source_dictionary, getattr(task, "target_dictionary", None) or task.source_dictionary
    keep = {}
    similarity, hooks = [], []
    for name, module in model.named_modules():
        try:
            kind, layer = attention_site(name)
        except ValueError:
            continue
        measure = HeadSimilarity(name, kind, layer)
        similarity.append(measure)

        def hook(module, args, kwargs, measure=measure, side=kind.split("-")[0]):
            query = kwargs.get("query", args[0] if args else None)
            key = kwargs.get("key", args[1] if len(args) > 1 else None)
            with torch.no_grad():
                attention, outputs = head_outputs(module, query, query if key is None else key,
                                                  kwargs.get("key_padding_mask"), kwargs.get("attn_mask"))
            measure.add(attention, outputs, keep[side])

        hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    modules: Dict[str, ModuleRouting] = {}
    batches = evaluation_batches(task, task.dataset(subset), max_tokens)
    try:
        for sample in tqdm(batches, total=len(batches), desc=label or checkpoint, unit="batch", file=sys.stderr,
                           disable=not progress):
            net_input = sample["net_input"]
            tokens = {"encoder": net_input["src_tokens"], "decoder": net_input.get("prev_output_tokens")}
            keep["encoder"] = tokens["encoder"].ne(source.pad())
            if tokens["decoder"] is not None:
                keep["decoder"] = tokens["decoder"].ne(target.pad())
            with torch.no_grad():
                model(**net_input)
            for name, routing in pop_named_routings(model):
                if routing.selected is None:  # every head shared: nothing routed
                    continue
                kind, layer = attention_site(name)
                side = kind.split("-")[0]
                flat_tokens = tokens[side].t().reshape(-1)  # time-first, as the routers see them
                flat_keep = keep[side].t().reshape(-1)
                if name not in modules:
                    modules[name] = ModuleRouting(name, kind, layer, routing.family, routing.probs.size(1),
                                                  routing.selected.size(1), routing.active_fraction)
                modules[name].add(routing.selected, routing.probs, routing.gates[:, 0], flat_keep, flat_tokens,
                                  routing.mean_alpha_shared)
    finally:
        for handle in hooks:
            handle.remove()
    families = {m.family for m in modules.values()}
    return {"checkpoint": checkpoint, "arch": getattr(cfg.model, "arch", None) or getattr(cfg.model, "_name", "?"),
            "family": "MoA" if "MoA" in families else "MoH" if families else "Transformer",
            "modules": sorted(modules.values(), key=_site_order),
            "similarity": sorted(similarity, key=_site_order),
            "dictionaries": {"encoder": source, "decoder": target}}


def _site_order(measure):
    from moa.models.routed_transformer import ATTENTION_TYPES

    return ATTENTION_TYPES.index(measure.kind), measure.layer
