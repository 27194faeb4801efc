"""A job under torch.profiler: moa's stages labelled, its time by kind of operator, and the operator table."""

import functools
import importlib

import torch

from benchmarks.harness.results import provenance_line, write_atomically
from benchmarks.harness.timing import synchronize

STAGES = {  # the code whose time the profiles label, as "moa:<label>"
    "moa.routing.TopKRouter.forward": "router (MoA)",
    "moa.routing.TwoStageHeadRouter.forward": "router (MoH)",
    "moa.routing.QueryNormHeadRouter.forward": "router (query-norm)",
    "moa.dispatch.ExpertDispatch.__init__": "dispatch plan (MoA)",
    "moa.dispatch.HeadPacking.__init__": "dispatch plan (MoH)",
    "moa.experts.ExpertLinear.forward": "expert projections (MoA)",
    "moa.experts.grouped_mm": "grouped GEMM (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.attention_core": "attention core (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.cached_key_value": "keys and values (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.forward": "routed attention module",
    "fairseq.modules.multihead_attention.MultiheadAttention.forward": "multi-head attention module",
    "fairseq.sequence_generator.SequenceGenerator._generate": "beam search",
}
# (kind, predicate on an operator's name): an operator counts under the first kind whose predicate holds
OP_KINDS = [
    ("grouped GEMM", lambda n: "grouped_mm" in n),
    ("attention", lambda n: "attention" in n),
    ("dense matmuls (router, projections, FFN)", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm")),
    ("top-k and sorting", lambda n: n in ("aten::topk", "aten::sort", "aten::argsort")),
    ("gathers", lambda n: n in ("aten::index_select", "aten::gather", "aten::index", "aten::embedding")),
    ("scatters", lambda n: n in ("aten::index_add_", "aten::index_copy_", "aten::index_copy", "aten::scatter",
                                 "aten::scatter_", "aten::scatter_add_", "aten::index_put_", "aten::_index_put_impl_")),
    ("copies and fills (padding, layouts)", lambda n: n in ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat",
                                                            "aten::clone")),
    ("plan arithmetic (counts, offsets)", lambda n: n in ("aten::cumsum", "aten::repeat_interleave", "aten::arange",
                                                          "aten::floor_divide", "aten::remainder", "aten::bincount")),
    ("the rest (softmax, elementwise)", lambda n: n.startswith("aten::")),
]


def op_kind(event):
    """The kind of OP_KINDS an operator's own time counts under: that of its nearest enclosing grouped GEMM or
    attention operator (whose kernels a CPU runs as smaller operators), else its own; None for what is not an
    operator (the stages' labels)."""
    kind, parent = None, event
    while parent is not None:
        name = parent.name
        own = next((k for k, match in OP_KINDS if match(name)), None) if name.startswith(("aten::", "moa::")) else None
        if own in ("grouped GEMM", "attention"):
            return own
        kind = kind or own
        parent = parent.cpu_parent
    return kind


class labelled_stages:
    """Within the context, the methods of :data:`STAGES` run inside ``torch.profiler.record_function``."""

    def __enter__(self):
        self.saved = []
        for dotted, label in STAGES.items():
            module_name, owner_name, attr = dotted.rsplit(".", 2)
            owner = getattr(importlib.import_module(module_name), owner_name)
            original = owner.__dict__[attr]
            function = original.__func__ if isinstance(original, staticmethod) else original

            def wrapper(*args, __f=function, __label=f"moa:{label}", **kwargs):
                with torch.profiler.record_function(__label):
                    return __f(*args, **kwargs)

            wrapped = functools.wraps(function)(wrapper)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            self.saved.append((owner, attr, original))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def profile(job, path, title, run, device=None, steps=1, row_limit=60):
    """Run ``job`` once to warm up, then ``steps`` times under torch.profiler with the stages labelled; write to
    ``path`` the stages' time, the time by kind of operator and the operator table, headed by ``title`` and the
    provenance ``run``. Returns, per step, {"ms_by_kind", "ms", "launches_per_step", "launches_are"}: on CUDA
    device time and kernels, on a CPU self CPU time and aten operators."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = getattr(device, "type", device) == "cuda"
    job()
    synchronize(device)
    with labelled_stages(), torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            job()
        synchronize(device)
    events = prof.key_averages()
    kinds = {kind: 0.0 for kind, _ in OP_KINDS}
    for event in prof.events():
        kind = op_kind(event)
        if kind is not None:
            kinds[kind] += (event.self_device_time_total if cuda else event.self_cpu_time_total) / steps / 1e3
    launches = (sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) if cuda
                else sum(e.count for e in events if e.key.startswith("aten::")))
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"# {title}", f"# {provenance_line(run)}", "", "## stages (inclusive CPU time of the labelled code)", ""]
    lines += [f"{e.key:40s} {e.cpu_time_total / 1e3:9.2f} ms  {e.count:6d} calls  {100 * e.cpu_time_total / max(total, 1):5.1f}%"
              for e in sorted((e for e in events if e.key.startswith("moa:")), key=lambda e: -e.cpu_time_total)]
    lines += ["", f"## time by kind of operator, ms per step ({'device' if cuda else 'self CPU'} time)", ""]
    lines += [f"{kind:55s} {ms:9.2f}" for kind, ms in kinds.items()]
    lines += ["", "## operators", "", events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                                   row_limit=row_limit)]
    write_atomically(path, "\n".join(lines) + "\n")
    return {"ms_by_kind": kinds, "ms": sum(kinds.values()), "launches_per_step": launches / steps,
            "launches_are": "kernels" if cuda else "aten ops"}
