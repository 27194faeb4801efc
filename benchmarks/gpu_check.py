"""The GPU check's measurements (run by ``bash benchmarks/gpu_check.sh``, which runs tests/gpu first).

    .venv/bin/python -m benchmarks.gpu_check                 # on a CUDA machine: writes benchmarks/results/gpu/
    .venv/bin/python -m benchmarks.gpu_check --device cpu --quick   # the same code at a small size on the CPU

* ``syncs``: one training step of each routed module (MoA 8K8E128D on its grouped projections, MoH at
  75%) in bfloat16 under ``torch.cuda.set_sync_debug_mode``: MoA's must not synchronise at all (it
  runs in mode "error"), MoH's synchronisations are counted (one per module expected); and one whole
  training step of ``moa_small`` with its criterion, counting every synchronisation with the caller
  that made it (fairseq's own padding checks among them). On a CPU the same steps run under the
  host-read counter of tests/host_reads.py instead.
* ``table``: one MoA module's forward and backward in bfloat16 at --tokens tokens (d_model 512), for
  8K8E128D and 16K32E256D: the expert projections as a loop over the experts, as torch's grouped GEMM,
  and dense multi-query attention of the same active width (k heads of D sharing one K/V head: MoA's
  active multiply-adds without routing), medians of interleaved rounds.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import moa  # noqa: F401  (registers the plugin)
from benchmarks.common import RESULTS, provenance, provenance_line, write_atomically
from moa import experts
from moa.experts import grouped_mm, looped_mm
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention

CONFIGS = {"8K8E128D": (8, 8, 128), "16K32E256D": (32, 16, 256)}
D_MODEL = 512


class MultiQueryAttention(nn.Module):
    """Dense attention with MoA's active shape: k query heads of width D over one shared K/V head."""

    def __init__(self, d_model, heads, head_dim):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(d_model, heads * head_dim, bias=False)
        self.k = nn.Linear(d_model, head_dim, bias=False)
        self.v = nn.Linear(d_model, head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d_model, bias=False)

    def forward(self, x):  # (T, B, C)
        t, b, _ = x.shape
        q = self.q(x).view(t, b, self.heads, self.head_dim).permute(1, 2, 0, 3)
        k, v = (proj(x).transpose(0, 1).unsqueeze(1) for proj in (self.k, self.v))
        o = F.scaled_dot_product_attention(q, k.expand(-1, self.heads, -1, -1), v.expand(-1, self.heads, -1, -1))
        return self.o(o.permute(2, 0, 1, 3).reshape(t, b, -1))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def module_step(module, x):
    y = module(x) if isinstance(module, MultiQueryAttention) else module(x, x, x, need_weights=False)[0]
    loss = y.float().square().mean()
    routing = getattr(module, "routing", None)
    if routing is not None:
        loss = loss + sum(routing.aux_losses().values())
    loss.backward()


def table(device, tokens, rounds, seq=512):
    bsz = max(tokens // seq, 1)
    rows = []
    for name, (num_experts, top_k, head_dim) in CONFIGS.items():
        torch.manual_seed(0)
        moa_module = MixtureOfAttentionHeads(D_MODEL, num_experts, top_k, head_dim, self_attention=True,
                                             router_init="normal").to(device, torch.bfloat16).train()
        moa_module.path = "routed"
        dense = MultiQueryAttention(D_MODEL, top_k, head_dim).to(device, torch.bfloat16)
        x = torch.randn(seq, bsz, D_MODEL, device=device, dtype=torch.bfloat16, requires_grad=True)
        jobs = {"loop": (moa_module, looped_mm), "grouped": (moa_module, grouped_mm), "dense": (dense, grouped_mm)}
        times = {job: [] for job in jobs}
        for round_ in range(rounds + 1):
            for job, (module, gemm) in jobs.items():
                experts.grouped_mm = gemm
                synchronize(device)
                start = time.perf_counter()
                module_step(module, x)
                synchronize(device)
                if round_:
                    times[job].append(time.perf_counter() - start)
        experts.grouped_mm = grouped_mm
        ms = {job: 1e3 * statistics.median(t) for job, t in times.items()}
        row = {"config": name, "tokens": bsz * seq, "device": device.type, "dtype": "bfloat16",
               "loop_ms": ms["loop"], "grouped_ms": ms["grouped"], "dense_ms": ms["dense"],
               "grouped_speedup_over_loop": statistics.median(a / b for a, b in zip(times["loop"], times["grouped"])),
               "grouped_over_dense": statistics.median(a / b for a, b in zip(times["grouped"], times["dense"]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def syncs(device):
    """What each training step synchronises (CUDA) or reads on the host (CPU)."""
    rows = []
    for name, build in (("MoA 8K8E128D module, grouped projections",
                         lambda: MixtureOfAttentionHeads(D_MODEL, 8, 8, 128, self_attention=True)),
                        ("MoA 16K32E256D module, grouped projections",
                         lambda: MixtureOfAttentionHeads(D_MODEL, 32, 16, 256, self_attention=True,
                                                         router_init="normal")),
                        ("MoH module, 4 shared + top-2 of 4, packed",
                         lambda: MixtureOfHeadsAttention(D_MODEL, 8, 4, 2, self_attention=True))):
        torch.manual_seed(0)
        module = build().to(device, torch.bfloat16).train()
        module.path = "packed" if isinstance(module, MixtureOfHeadsAttention) else "routed"
        x = torch.randn(64, 8, D_MODEL, device=device, dtype=torch.bfloat16, requires_grad=True)
        module_step(module, x)  # warm up (allocations, kernels)
        calls = count_syncs(device, lambda: module_step(module, x), strict=module.path == "routed")
        rows.append({"step": name, "syncs": len(calls), "where": sorted(set(calls))})
        print(json.dumps(rows[-1]), flush=True)
    rows.append(whole_model_syncs(device))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def whole_model_syncs(device):
    from benchmarks.moa_speed import criterion_for, shape_model, synthetic_batch

    model = shape_model("small", "moa_small", device).to(torch.bfloat16).train()
    sample = synthetic_batch(model, 32, 16, 16, device)
    sample["target"][0, -3:] = model.decoder.padding_idx  # real batches have padding
    criterion = criterion_for(model, "moa_small")

    def step():
        loss, _, _ = criterion(model, sample)
        loss.backward()
    step()
    calls = count_syncs(device, step, strict=False)
    return {"step": "moa_small training step (forward, backward, criterion)", "syncs": len(calls),
            "where": sorted(set(calls))}


def count_syncs(device, run, strict):
    """The callers of every synchronisation ``run`` makes (CUDA: torch's sync debug mode, in "error" mode
    when ``strict``; CPU: the host reads of tests/host_reads.py)."""
    if device.type != "cuda":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from host_reads import HostReads

        with HostReads() as reads:
            run()
        calls = [f"{name} at {where}" for name, where in reads.calls]
        if strict and any("/moa/" in c for c in calls):
            raise RuntimeError(f"the step read the host: {calls}")
        return calls
    torch.cuda.synchronize()
    if strict:
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def markdown(report):
    lines = [f"# The GPU check ({report['device']})", "", "## Synchronisations of one training step", "",
             "| step | synchronisations | where |", "|---|---|---|"]
    for r in report["syncs"]:
        lines.append(f"| {r['step']} | {r['syncs']} | {'; '.join(r['where']) or '-'} |")
    lines += ["", "## One MoA module, forward and backward in bfloat16", "",
              "| config | tokens | loop ms | grouped ms | dense MQA ms | grouped speed-up over the loop | "
              "grouped / dense |", "|---|---|---|---|---|---|---|"]
    for r in report["table"]:
        lines.append(f"| {r['config']} | {r['tokens']:,} | {r['loop_ms']:.2f} | {r['grouped_ms']:.2f} | "
                     f"{r['dense_ms']:.2f} | {r['grouped_speedup_over_loop']:.2f}x | {r['grouped_over_dense']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, two rounds: a smoke run")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/results/gpu/gpu-check.json on a "
                                      "GPU, a temporary folder on the CPU")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu runs the same code on the CPU")
    device = torch.device(args.device)
    tokens, rounds = (1024, 2) if args.quick else (args.tokens, args.rounds)
    out = args.out or (os.path.join(RESULTS, "gpu", "gpu-check.json") if device.type == "cuda" else
                       os.path.join(tempfile.mkdtemp(prefix="moa-gpu-check-"), "cpu.json"))
    report = {"run": provenance("gpu_check", argv), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
              else "CPU (host reads counted in place of synchronisations)"}
    report["syncs"] = syncs(device)
    report["table"] = table(device, tokens, rounds)
    text = markdown(report) + "\n\n" + provenance_line(report["run"])
    print("\n" + text)
    write_atomically(out, json.dumps(report, indent=1))
    write_atomically(os.path.splitext(out)[0] + ".md", text + "\n")
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
