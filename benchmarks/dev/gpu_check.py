"""The GPU check's measurements (``bash benchmarks/dev/gpu_check.sh`` runs tests/gpu first, then this).

    .venv/bin/python -m benchmarks.dev.gpu_check             # on a CUDA machine: writes benchmarks/speed/results/gpu/
    .venv/bin/python -m benchmarks.dev.gpu_check --device cpu --quick   # the same code at a small size on the CPU

Sections: ``syncs`` (what a training step of each routed module and of ``moa_small`` synchronises; on a
CPU, its host reads), ``table`` (MoA modules in bfloat16: the per-expert loop, the grouped GEMM and dense
multi-query attention of the same active width, eager and compiled), ``profile`` (device time by kind of
operator, 16K32E256D and its dense twin; operator tables in profile-*.txt), ``models`` (whole models on
the demo corpus: fairseq-train and fairseq-generate in bf16, time ratios beside MACs ratios).
See benchmarks/dev/README.md.
"""

import copy
import json
import os
import re
import statistics
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.fairseq_runs import fairseq_train, inner_wps
from benchmarks.harness.host_reads import HostReads
from benchmarks.harness.macs import forward_macs, routed_paths
from benchmarks.harness.models import criterion_for, shape_model, synthetic_batch
from benchmarks.harness.profiling import profile
from benchmarks.harness.results import provenance, provenance_line, study_parser, study_results, table, write_result
from benchmarks.harness.timing import interleaved, ms, ratio
from moa import experts
from moa.experts import grouped_mm, looped_mm
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routed_attention import compile_routed_attention

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


def module_step(module, x):
    y = module(x) if isinstance(module, MultiQueryAttention) else module(x, x, x, need_weights=False)[0]
    loss = y.float().square().mean()
    routing = getattr(module, "routing", None)
    if routing is not None:
        loss = loss + sum(routing.aux_losses().values())
    loss.backward()


def module_table(device, tokens, rounds, seq=512):
    bsz = max(tokens // seq, 1)
    rows = []
    for name, (num_experts, top_k, head_dim) in CONFIGS.items():
        torch.manual_seed(0)
        moa_module = MixtureOfAttentionHeads(D_MODEL, num_experts, top_k, head_dim, self_attention=True,
                                             router_init="normal").to(device, torch.bfloat16).train()
        moa_module.path = "routed"
        dense = MultiQueryAttention(D_MODEL, top_k, head_dim).to(device, torch.bfloat16)
        compiled_moa, compiled_dense = copy.deepcopy(moa_module), copy.deepcopy(dense)
        compile_routed_attention(compiled_moa)
        compiled_dense.compile()
        x = torch.randn(seq, bsz, D_MODEL, device=device, dtype=torch.bfloat16, requires_grad=True)
        jobs = {"loop": (moa_module, looped_mm), "grouped": (moa_module, grouped_mm), "dense": (dense, grouped_mm),
                "grouped_compiled": (compiled_moa, grouped_mm), "dense_compiled": (compiled_dense, grouped_mm)}
        for module, _ in jobs.values():  # compile (and warm up) before any round is timed
            module_step(module, x)
        times = interleaved({job: (lambda m=module, g=gemm: (setattr(experts, "grouped_mm", g), module_step(m, x)))
                             for job, (module, gemm) in jobs.items()}, rounds, device=device)
        experts.grouped_mm = grouped_mm
        row = {"config": name, "tokens": bsz * seq, "device": device.type, "dtype": "bfloat16",
               **{f"{job}_ms": ms(t) for job, t in times.items()},
               "grouped_speedup_over_loop": ratio(times["loop"], times["grouped"]),
               "grouped_over_dense": ratio(times["grouped"], times["dense"]),
               "compiled_grouped_over_compiled_dense": ratio(times["grouped_compiled"], times["dense_compiled"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile_table(device, tokens, out_dir, run, seq=512, steps=3):
    """Device time by kind of operator and kernels launched, per forward and backward step, of the
    16K32E256D module (grouped projections) and its dense multi-query twin (harness.profiling); the whole
    operator tables go to ``out_dir``/profile-*.txt."""
    num_experts, top_k, head_dim = CONFIGS["16K32E256D"]
    torch.manual_seed(0)
    moa_module = MixtureOfAttentionHeads(D_MODEL, num_experts, top_k, head_dim, self_attention=True,
                                         router_init="normal").to(device, torch.bfloat16).train()
    moa_module.path = "routed"
    modules = {"MoA 16K32E256D": moa_module,
               "dense multi-query twin": MultiQueryAttention(D_MODEL, top_k, head_dim).to(device, torch.bfloat16)}
    x = torch.randn(seq, max(tokens // seq, 1), D_MODEL, device=device, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for name, module in modules.items():
        path = os.path.join(out_dir, f"profile-{name.split()[1] if name.startswith('MoA') else 'dense'}.txt")
        rows.append({"module": name, "tokens": x.size(0) * x.size(1),
                     **profile(lambda m=module: module_step(m, x), path, f"{name}, forward and backward, bfloat16", run,
                               device, steps)})
        print(json.dumps(rows[-1]), flush=True)
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
    when ``strict``; CPU: the host reads of benchmarks.harness.host_reads)."""
    if device.type != "cuda":
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


# (routed arch, the Transformer arch it is compared with): --max-tokens is the same for every model
MODEL_PAIRS = [("moa_base", "transformer_wmt_en_de"), ("moh_base", "transformer_wmt_en_de"),
               ("moa_big", "transformer_vaswani_wmt_en_de_big")]


def whole_models(device, quick, work):
    """fairseq-train --bf16 words/s and fairseq-generate --bf16 beam-4 sentences/s of each arch of
    MODEL_PAIRS on the demo corpus, in one call; each time ratio to its Transformer beside the MACs ratio."""
    from fairseq.data import Dictionary

    from moa.models.build import build_translation_model
    from moa_tools import USER_DIR, fairseq_command, run_logged
    from moa_tools.commands.demo import write_corpus

    raw, data_bin = os.path.join(work, "raw"), os.path.join(work, "data-bin")
    write_corpus(raw, {"train": 2000 if quick else 40000, "valid": 50, "test": 64 if quick else 512}, seed=1)
    run_logged([fairseq_command("fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
                "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
                "--destdir", data_bin, "--joined-dictionary", "--workers", "4"])
    dictionary = Dictionary.load(os.path.join(data_bin, "dict.en.txt"))
    updates, length = (4, 8) if quick else (100, 24)
    cpu = [] if device.type == "cuda" else ["--cpu"]
    archs = list(dict.fromkeys(a for pair in MODEL_PAIRS for a in pair))
    measured = {}
    for arch in archs:
        save = os.path.join(work, arch)
        criterion = "label_smoothed_cross_entropy" if arch.startswith("transformer") else "moa_label_smoothed_cross_entropy"
        log = fairseq_train(data_bin, ["--arch", arch, "--share-all-embeddings", "--criterion", criterion,
                                       "--label-smoothing", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
                                       "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "50",
                                       "--max-tokens", "1024" if quick else "8192", "--bf16", "--max-update", str(updates),
                                       "--log-format", "simple", "--log-interval", "2" if quick else "25",
                                       "--disable-validation", "--no-epoch-checkpoints", "--no-save-optimizer-state",
                                       "--num-workers", "0", *cpu], save)
        wps = inner_wps(log)
        gen = run_logged([fairseq_command("fairseq-generate"), data_bin, "--user-dir", USER_DIR, "--path",
                          os.path.join(save, "checkpoint_last.pt"), "--gen-subset", "test", "--beam", "4",
                          "--batch-size", "128", "--min-len", str(length), "--max-len-a", "0", "--max-len-b",
                          str(length), "--bf16", "--quiet", "--num-workers", "0", *cpu],
                         os.path.join(work, f"generate-{arch}.log"))
        sentences_per_s = float(re.search(r"Translated [\d,]+ sentences .* \(([\d.]+) sentences/s", gen).group(1))
        torch.manual_seed(0)
        model = routed_paths(build_translation_model(arch, dictionary).eval())
        tokens = torch.randint(4, len(dictionary), (1, length))
        measured[arch] = {"train_words_per_s": statistics.median(wps) if wps else float("nan"),
                          "generate_sentences_per_s": sentences_per_s,
                          "macs_per_target_token": forward_macs(model, tokens, tokens) / length}
        print(json.dumps({"arch": arch, **measured[arch]}), flush=True)
    rows = []
    for routed, transformer in MODEL_PAIRS:
        m, t = measured[routed], measured[transformer]
        rows.append({"arch": routed, "against": transformer, **m,
                     "train_time_ratio": t["train_words_per_s"] / m["train_words_per_s"],
                     "generate_time_ratio": t["generate_sentences_per_s"] / m["generate_sentences_per_s"],
                     "macs_ratio": m["macs_per_target_token"] / t["macs_per_target_token"]})
    return rows


def markdown(report):
    lines = [f"# The GPU check ({report['device']})", "", "## Synchronisations of one training step", ""]
    lines += table(["step", "synchronisations", "where"],
                   [[r["step"], r["syncs"], "; ".join(r["where"]) or "-"] for r in report["syncs"]])
    lines += ["", "## One MoA module, forward and backward in bfloat16", ""]
    lines += table(["config", "tokens", "loop ms", "grouped ms", "dense MQA ms", "grouped speed-up over the loop",
                    "grouped / dense", "compiled: grouped ms", "dense ms", "grouped / dense"],
                   [[r["config"], f"{r['tokens']:,}", f"{r['loop_ms']:.2f}", f"{r['grouped_ms']:.2f}",
                     f"{r['dense_ms']:.2f}", f"{r['grouped_speedup_over_loop']:.2f}x", f"{r['grouped_over_dense']:.2f}x",
                     f"{r['grouped_compiled_ms']:.2f}", f"{r['dense_compiled_ms']:.2f}",
                     f"{r['compiled_grouped_over_compiled_dense']:.2f}x"] for r in report["table"]])
    if report.get("profile"):
        kinds = list(report["profile"][0]["ms_by_kind"])
        lines += ["", "## Where a forward and backward step's time goes (torch.profiler, ms per step)", ""]
        lines += table(["module", *kinds, "total", "launches per step"],
                       [[r["module"], *(f"{r['ms_by_kind'][k]:.2f}" for k in kinds), f"{r['ms']:.2f}",
                         f"{r['launches_per_step']:.0f} {r['launches_are']}"] for r in report["profile"]])
    if report.get("models"):
        lines += ["", "## Whole models, bfloat16, the demo corpus", ""]
        lines += table(["arch", "against", "train words/s", "train time ratio", "generate sentences/s",
                        "generate time ratio", "MACs ratio"],
                       [[r["arch"], r["against"], f"{r['train_words_per_s']:,.0f}", f"{r['train_time_ratio']:.2f}x",
                         f"{r['generate_sentences_per_s']:.1f}", f"{r['generate_time_ratio']:.2f}x",
                         f"{r['macs_ratio']:.2f}x"] for r in report["models"]])
    return "\n".join(lines)


def main(argv=None):
    parser = study_parser("dev.gpu_check", __doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, two rounds, whole models for a few "
                                                             "updates on a small corpus: a smoke run")
    parser.add_argument("--skip-models", action="store_true", help="leave out the whole models")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/speed/results/gpu/gpu-check.json on a "
                                      "GPU, a temporary folder on the CPU")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu runs the same code on the CPU")
    device = torch.device(args.device)
    tokens, rounds = (1024, 2) if args.quick else (args.tokens, args.rounds)
    out = args.out or (study_results("speed", "gpu", "gpu-check.json") if device.type == "cuda" else
                       os.path.join(tempfile.mkdtemp(prefix="moa-gpu-check-"), "cpu.json"))
    report = {"run": provenance("dev.gpu_check", argv), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
              else "CPU (host reads counted in place of synchronisations)"}
    report["syncs"] = syncs(device)
    report["table"] = module_table(device, tokens, rounds)
    report["profile"] = profile_table(device, tokens, os.path.dirname(os.path.abspath(out)), report["run"])
    if not args.skip_models:
        with tempfile.TemporaryDirectory(prefix="moa-gpu-models-") as work:
            report["models"] = whole_models(device, args.quick, work)
    write_result(out, report, markdown(report) + "\n\n" + provenance_line(report["run"]))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
