"""MoA and MoH speed and memory, side by side with fairseq's multi-head attention, in one run.

    .venv/bin/python -m benchmarks.speed.models_and_modules                # every section (about 30 min)
    .venv/bin/python -m benchmarks.speed.models_and_modules --quick        # a smaller grid: a smoke run
    .venv/bin/python -m benchmarks.speed.models_and_modules --device cuda  # the same on a GPU
    .venv/bin/python -m benchmarks.speed.models_and_modules --sections small --profile DIR

Sections: ``modules`` (MoA modules at d_model 512 against fairseq's 8x64 attention, forward and
backward, against a float32 matmul peak, with the share of time that is not the GEMMs and attention and
the authors' layer design), ``moh`` (MoH at 75% and 50% of 16 heads, routed and dense-masked),
``crossover`` (each routed path against its dense alternative by size), ``small`` and ``models`` (whole
models at the Multi30k and base shapes: training step, beam-4 decoding, K/V cache, peak memory) and
``experts`` (the same for MoA with 4 to 32 experts at the Multi30k shape).
What each measures: benchmarks/speed/README.md. A partial run keeps the other sections of --out.
"""

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import moa  # noqa: F401  (registers the plugin)
from benchmarks.harness.macs import forward_macs, moa_module_macs, moh_module_macs, routed_paths
from benchmarks.harness.models import (SHAPES, beam_decode, cached_attention_step, criterion_for, shape_model,
                                       synthetic_batch, train_step)
from benchmarks.harness.profiling import profile
from benchmarks.harness.results import (ROOT, provenance, runs_lines, sectioned_report, study_parser, study_results,
                                        table, write_result)
from benchmarks.harness.timing import interleaved, median_time, ms, ratio
from benchmarks.speed.authors_style_moa import AuthorsStyleMoA
from fairseq.modules.multihead_attention import MultiheadAttention
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention

SECTIONS = ("modules", "moh", "crossover", "small", "experts", "models")
D_MODEL = 512
MOA_CONFIGS = {"8K8E128D": (8, 8, 128), "16K32E256D": (32, 16, 256), "2K8E64D": (8, 2, 64), "4K16E64D": (16, 4, 64)}
MOH_D_MODEL, MOH_HEADS = 1024, 16
MOH_CONFIGS = {"MoH 75% (8 + top-4 of 8)": (8, 4), "MoH 50% (4 + top-4 of 12)": (4, 4)}
CROSSOVER_MODULES = {  # name -> (d_model, build); the routed/sparse path against the dense one
    "MoA 4K8E64D, d 256 (moa_small)": (256, lambda: MixtureOfAttentionHeads(256, 8, 4, 64, self_attention=True)),
    "MoA 2K8E64D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 8, 2, 64, self_attention=True)),
    "MoA 4K16E64D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 16, 4, 64, self_attention=True)),
    "MoA 16K32E256D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 32, 16, 256, self_attention=True)),
    "MoH 2 + top-1 of 2, d 256 (moh_small)": (256, lambda: MixtureOfHeadsAttention(256, 4, 2, 1, self_attention=True)),
    "MoH 4 + top-4 of 12, d 1024": (1024, lambda: MixtureOfHeadsAttention(1024, 16, 4, 4, self_attention=True)),
}


def run_module(module, x, backward):
    out = module(x) if isinstance(module, AuthorsStyleMoA) else module(x, x, x, need_weights=False)[0]
    if backward:
        out.sum().backward()


def matmul_peak(device, repeats):
    a, b = (torch.randn(2048, 2048, device=device) for _ in range(2))
    return 2 * 2048 ** 3 / median_time(lambda: a @ b, max(repeats, 5), 2, device)


def compute_floor(module, x, bsz, seq):
    """The same GEMMs and attention kernel on ready-made contiguous inputs, forward and backward:
    what the module would cost if routing, grouping, scatter and gating were free."""
    m, dim = module, D_MODEL
    flat = x.detach().reshape(-1, dim)
    with torch.no_grad():
        experts = m.router(flat).selected
    sizes = torch.bincount(experts.flatten(), minlength=m.num_experts).tolist()
    leaf = lambda *shape: torch.randn(*shape, device=x.device, requires_grad=True)  # noqa: E731
    rows_q, rows_o = [leaf(n, dim) for n in sizes], [leaf(n, m.head_dim) for n in sizes]
    kv_in, q_in = leaf(flat.size(0), dim), leaf(bsz, m.top_k, seq, m.head_dim)

    def step():
        if m.top_k == m.num_experts:
            outs = [kv_in @ m.q_experts.weight.view(dim, -1),
                    leaf(flat.size(0), m.num_experts * m.head_dim) @ m.o_experts.weight.reshape(-1, dim)]
        else:
            wq, wo = m.q_experts.weight.unbind(1), m.o_experts.weight.unbind(0)
            outs = [r @ w for r, w in zip(rows_q, wq)] + [r @ w for r, w in zip(rows_o, wo)]
        keys, values = (proj(kv_in).view(bsz, 1, seq, m.head_dim) for proj in (m.k_proj, m.v_proj))
        outs.append(F.scaled_dot_product_attention(q_in, keys, values, enable_gqa=True))
        sum(o.sum() for o in outs).backward()

    return step


def module_grid(device, repeats, token_counts, seq_lens, peak):
    """Every MoA configuration and fairseq's 8x64 attention, forward and forward+backward, by size."""
    rows = []
    for seq in seq_lens:
        for tokens in [t for t in token_counts if t >= seq]:
            bsz = tokens // seq
            x = torch.randn(seq, bsz, D_MODEL, device=device, requires_grad=True)
            for name in ["MHA 8x64", *MOA_CONFIGS]:
                torch.manual_seed(0)
                if name == "MHA 8x64":
                    module, macs = MultiheadAttention(D_MODEL, 8, self_attention=True), moh_module_macs(D_MODEL, 8, 8, seq)
                else:
                    experts, k, head = MOA_CONFIGS[name]
                    module = MixtureOfAttentionHeads(D_MODEL, experts, k, head, self_attention=True)
                    macs = moa_module_macs(D_MODEL, experts, k, head, seq)
                module = module.to(device)
                row = {"module": name, "tokens": tokens, "seq_len": seq, "batch": bsz}
                for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                    with torch.enable_grad() if backward else torch.no_grad():
                        seconds = median_time(lambda: run_module(module, x, backward), repeats, 2, device)
                    row[f"{mode}_ms"] = seconds * 1e3
                    row[f"{mode}_peak_fraction"] = 2 * macs * tokens * (3 if backward else 1) / seconds / peak
                if name != "MHA 8x64":
                    floor = median_time(compute_floor(module, x, bsz, seq), repeats, 2, device)
                    row["fwd_bwd_overhead_fraction"] = 1 - floor / (row["fwd_bwd_ms"] / 1e3)
                    if name in ("8K8E128D", "16K32E256D") and tokens == 1024 and seq == 64:
                        authors = AuthorsStyleMoA(module)
                        row["authors_style_fwd_bwd_ms"] = 1e3 * median_time(lambda: run_module(authors, x, True),
                                                                            repeats, 2, device)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def moh_grid(device, repeats, shapes):
    """MoH against fairseq's MHA of the same shape, routed and dense-masked; ``shapes``: (seq_len, batch) pairs."""
    torch.manual_seed(0)
    modules = {"MHA 16x64": MultiheadAttention(MOH_D_MODEL, MOH_HEADS, self_attention=True).to(device)}
    for name, (shared, top_k) in MOH_CONFIGS.items():
        for suffix, path in (("", "packed"), (", dense-masked", "all-heads")):
            module = MixtureOfHeadsAttention(MOH_D_MODEL, MOH_HEADS, shared, top_k, self_attention=True).to(device)
            if suffix:
                module.load_state_dict(modules[name].state_dict())
            module.path = path
            modules[name + suffix] = module
    rows = []
    for seq, bsz in shapes:
        x = torch.randn(seq, bsz, MOH_D_MODEL, device=device, requires_grad=True)
        jobs = {(name, mode): (lambda m=module, b=backward: run_with_grad(m, x, b))
                for name, module in modules.items() for mode, backward in (("fwd", False), ("fwd_bwd", True))}
        times = interleaved(jobs, repeats, device=device)
        for name, module in modules.items():
            active = MOH_HEADS if name.startswith("MHA") else round(module.router.active_fraction * MOH_HEADS)
            row = {"module": name, "seq_len": seq, "batch": bsz, "active_fraction": active / MOH_HEADS,
                   "macs_ratio": moh_module_macs(MOH_D_MODEL, MOH_HEADS, active, seq)
                   / moh_module_macs(MOH_D_MODEL, MOH_HEADS, MOH_HEADS, seq)}
            for mode in ("fwd", "fwd_bwd"):
                row[f"{mode}_ms"] = ms(times[(name, mode)])
                row[f"{mode}_ratio"] = ratio(times[(name, mode)], times[("MHA 16x64", mode)])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_with_grad(module, x, backward):
    with torch.enable_grad() if backward else torch.no_grad():
        run_module(module, x, backward)


def use_path(module, dense):
    """MoA: every expert in one matmul (dense) or per expert on its rows; MoH: every head computed and
    gated (dense) or the active heads packed, in training and in decoding alike."""
    if isinstance(module, MixtureOfAttentionHeads):
        module.path = "dense" if dense else "routed"
    else:
        module.path = "all-heads" if dense else "packed"


def crossover(device, repeats, token_counts, seq=16):
    """Each routed module's two paths in turn at growing token counts (sequences of ``seq`` tokens), forward
    alone, forward+backward, and one incremental decoding step over ``seq`` cached positions."""
    rows = []
    for name, (dim, build) in CROSSOVER_MODULES.items():
        torch.manual_seed(0)
        module = build().to(device)
        for tokens in token_counts:
            bsz = max(tokens // seq, 1)
            x = torch.randn(seq, bsz, dim, device=device, requires_grad=True)
            jobs = {"fwd": lambda: run_with_grad(module, x, False), "fwd_bwd": lambda: run_with_grad(module, x, True),
                    "decode_step": decode_step(module.eval(), x.detach(), torch.randn(1, bsz, dim, device=device))}
            module.train()
            for mode, job in jobs.items():
                times = interleaved({dense: (lambda d=dense: (use_path(module, d), job()))
                                     for dense in (True, False)}, repeats, device=device)
                row = {"module": name, "tokens": bsz * seq if mode != "decode_step" else bsz, "mode": mode,
                       "dense_ms": ms(times[True]), "sparse_ms": ms(times[False]),
                       "sparse_over_dense": ratio(times[False], times[True])}
                if isinstance(module, MixtureOfAttentionHeads):
                    row["rows_per_expert"] = row["tokens"] * module.top_k / module.num_experts
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def decode_step(module, prefix, step):
    """A job that runs one incremental step of ``module`` (query ``step``) after the cached ``prefix``."""
    state = {}
    with torch.no_grad():
        module(prefix, prefix, prefix, incremental_state=state, need_weights=False)
    return cached_attention_step(module, state, step)


def kv_cache_bytes_per_token_layer(model, device, bsz=4, steps=8):
    model.eval()
    src = torch.randint(4, 100, (bsz, 10), device=device)
    prev = torch.randint(4, 100, (bsz, steps), device=device)
    state = {}
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=torch.full((bsz,), 10, device=device))
        for t in range(steps):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
    total = 0
    for layer in model.decoder.layers:
        buffer = layer.self_attn._get_input_buffer(state)
        total += sum(buffer[k].numel() * buffer[k].element_size() for k in ("prev_key", "prev_value"))
    return total / (bsz * steps * len(model.decoder.layers))


def side_by_side(shape, device, rounds, profile_dir=None):
    """Whole models of one shape (harness.models.SHAPES): a training step and beam-4 decoding, in turn
    round after round, ratios to the first arch; peak training memory from a fresh process per model;
    with ``profile_dir``, one step and one decoding of each under torch.profiler, written there."""
    archs, _, _, bsz, length, sentences = SHAPES[shape]
    jobs, rows = {}, []
    for arch in archs:
        model = shape_model(shape, arch, device)
        sample = synthetic_batch(model, bsz, length, length, device)
        jobs[(arch, "train")] = train_step(model, arch.split("/")[0], sample)
        jobs[(arch, "decode")] = beam_decode(model, sample, sentences, length)
        rows.append({"arch": arch, "batch": f"{bsz}x{length}", "beam4_sentences": sentences, "rounds": rounds,
                     "parameters": sum(p.numel() for p in model.parameters()),
                     "forward_macs_per_target_token": training_batch_macs(shape, arch, sample),
                     "kv_cache_bytes_per_token_per_layer": kv_cache_bytes_per_token_layer(model, device)})
    times = interleaved(jobs, rounds, device=device)
    for row in rows:
        for job in ("train", "decode"):
            row[f"{job}_ms"] = ms(times[(row["arch"], job)])
            row[f"{job}_ratio"] = ratio(times[(row["arch"], job)], times[(archs[0], job)])
        row["train_words_per_s"] = bsz * length / (row["train_ms"] / 1e3)
        row["macs_ratio"] = row["forward_macs_per_target_token"] / rows[0]["forward_macs_per_target_token"]
        row["beam4_sentences_per_s"] = sentences / (row["decode_ms"] / 1e3)
        out = subprocess.run([sys.executable, "-m", "benchmarks.speed.models_and_modules", "--memory-child", shape,
                              row["arch"], "--device", device.type], capture_output=True, text=True, check=True, cwd=ROOT)
        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(row), flush=True)
    for row in rows:
        row["peak_memory_ratio"] = row["peak_mb"] / rows[0]["peak_mb"]
        row["saved_activations_ratio"] = row["saved_activations_mb"] / rows[0]["saved_activations_mb"]
    for (arch, job), run in jobs.items() if profile_dir else ():
        profile(run, os.path.join(profile_dir, f"{shape}-{arch.replace('/', '-')}-{job}.txt"),
                f"{arch}, {job}: {bsz}x{length} training batch, beam-4 decoding of {sentences} sentences forced to "
                f"{length} tokens", provenance("speed.models_and_modules"), device)
    return rows


def training_batch_macs(shape, arch, sample):
    """Forward MACs per target token of ``arch`` on the timed training batch, counted by torch's FLOP counter
    on the routed paths (:func:`benchmarks.harness.macs.forward_macs`), on a fresh copy of the model."""
    model = routed_paths(shape_model(shape, arch).eval())
    net = sample["net_input"]
    return forward_macs(model, net["src_tokens"].cpu(), net["prev_output_tokens"].cpu()) / sample["ntokens"]


def memory_child(shape, arch, device):
    """Printed as JSON: the peak memory of training steps of ``arch`` (CPU: resident set; CUDA: allocated)
    over two steps after a first, its rise above the memory held before them, and the MB of the distinct
    tensors one forward saves for backward (parameters excluded)."""
    _, _, _, bsz, length, _ = SHAPES[shape]
    model = shape_model(shape, arch, device)
    sample = synthetic_batch(model, bsz, length, length, device)
    step = train_step(model, arch.split("/")[0], sample)
    step()  # the optimizer's state now exists
    before = memory_mb(device, "VmRSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:  # Linux: writing 5 to clear_refs resets the peak resident set size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    for _ in range(2):
        step()
    peak = memory_mb(device, "VmHWM")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        criterion_for(model, arch)(model, sample)
    print(json.dumps({"peak_mb": peak, "step_rise_mb": peak - before,
                      "saved_activations_mb": sum(storages.values()) / 2 ** 20}))


def memory_mb(device, field):
    """CUDA: allocated (VmRSS) or its peak (VmHWM); CPU: that field of /proc/self/status."""
    if device.type == "cuda":
        return (torch.cuda.memory_allocated() if field == "VmRSS" else torch.cuda.max_memory_allocated()) / 2 ** 20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def markdown(report):
    lines = [f"MoA and MoH benchmark, {report['machine']}, torch {report['torch']}, {report['threads']} threads."
             + (f" Matmul peak (float32 2048^3): {report['peak_gflops']:.0f} GFLOP/s." if "peak_gflops" in report else "")]
    mha = {(r["tokens"], r["seq_len"]): r["fwd_bwd_ms"] for r in report["modules"] if r["module"] == "MHA 8x64"}
    if report["modules"]:
        lines += [""] + table(["module", "tokens", "seq", "fwd ms", "fwd+bwd ms", "fwd+bwd % of peak", "vs MHA (fwd+bwd)",
                               "overhead", "authors-style fwd+bwd ms", "speed-up"],
                              [[r["module"], r["tokens"], r["seq_len"], f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
                                f"{100 * r['fwd_bwd_peak_fraction']:.0f}%",
                                f"{r['fwd_bwd_ms'] / mha[(r['tokens'], r['seq_len'])]:.2f}x",
                                f"{100 * r['fwd_bwd_overhead_fraction']:.0f}%" if "fwd_bwd_overhead_fraction" in r else "",
                                f"{r['authors_style_fwd_bwd_ms']:.1f}" if "authors_style_fwd_bwd_ms" in r else "",
                                f"{r['authors_style_fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if "authors_style_fwd_bwd_ms" in r
                                else ""] for r in report["modules"]])
    if report.get("crossover"):
        lines += ["", "Routed paths against the dense ones (MoA: every expert in one matmul; MoH: every head computed "
                  "and gated), medians of interleaved rounds; decode_step: one incremental step, one query per "
                  "sentence, tokens = sentences.", ""]
        lines += table(["module", "mode", "tokens", "rows per expert", "dense ms", "routed ms", "routed / dense"],
                       [[r["module"], r["mode"], r["tokens"], f"{r['rows_per_expert']:.0f}" if "rows_per_expert" in r else "",
                         f"{r['dense_ms']:.2f}", f"{r['sparse_ms']:.2f}", f"{r['sparse_over_dense']:.2f}"]
                        for r in report["crossover"]])
    for section, title in (("small", "Multi30k shape (d_model 256, 3+3 layers, 4 heads of 64, 8,000 symbols)"),
                           ("experts", "MoA's expert count at the Multi30k shape (k = 4, D = 64; moa_small has 8)"),
                           ("models", "base shapes (d_model 512, 6+6 layers, 32,768 symbols)")):
        if report.get(section):
            r0 = report[section][0]
            lines += ["", f"{title}: a training step on {r0['batch']} tokens, beam-4 decoding of {r0['beam4_sentences']} "
                      f"sentences; medians of {r0['rounds']} interleaved rounds, ratios to {r0['arch']} per round.", ""]
            lines += table(["arch", "parameters", "MACs ratio", "train step ms", "ratio", "train words/s",
                            "beam-4 decode ms", "ratio",
                            "sentences/s", "K/V cache bytes/token/layer", "peak train memory MB", "ratio",
                            "saved activations MB", "ratio"],
                           [[r["arch"], f"{r['parameters']:,}",
                             f"{r['macs_ratio']:.2f}x" if "macs_ratio" in r else "",
                             f"{r['train_ms']:.0f}", f"{r['train_ratio']:.2f}x",
                             f"{r['train_words_per_s']:.0f}", f"{r['decode_ms']:.0f}", f"{r['decode_ratio']:.2f}x",
                             f"{r['beam4_sentences_per_s']:.1f}", f"{r['kv_cache_bytes_per_token_per_layer']:.0f}",
                             f"{r['peak_mb']:.0f}", f"{r['peak_memory_ratio']:.2f}", f"{r['saved_activations_mb']:.0f}",
                             f"{r['saved_activations_ratio']:.2f}"] for r in report[section]])
    if report.get("moh"):
        lines += [""] + table(["MoH module (d_model 1024, 16x64)", "seq x batch", "active heads", "MACs ratio", "fwd ms",
                               "fwd ratio", "fwd+bwd ms", "fwd+bwd ratio", "fwd+bwd ratio / MACs ratio"],
                              [[r["module"], f"{r['seq_len']}x{r['batch']}", f"{100 * r['active_fraction']:.0f}%",
                                f"{r['macs_ratio']:.2f}", f"{r['fwd_ms']:.1f}", f"{r['fwd_ratio']:.2f}",
                                f"{r['fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_ratio']:.2f}",
                                f"{r['fwd_bwd_ratio'] / r['macs_ratio']:.2f}"] for r in report["moh"]])
    return "\n".join(lines)


def main(argv=None):
    parser = study_parser("speed.models_and_modules", __doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a few shapes, 2 repeats and rounds, no base models or expert counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the whole-model sections")
    parser.add_argument("--profile", metavar="DIR", help="also profile one training step and one decoding of each "
                                                         "whole model with torch.profiler, tables written to DIR")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which sections to run (default: all); a partial run keeps the others of --out")
    parser.add_argument("--out", help="JSON path (a .md beside it); default results/cpu/<device>.json")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.memory_child:
        return memory_child(*args.memory_child, device)
    repeats = 2 if args.quick else args.repeats
    out = args.out or study_results("speed", "cpu", f"{device.type}{'-quick' if args.quick else ''}.json")
    sections = [s for s in args.sections if not (args.quick and s in ("experts", "models"))]
    report = sectioned_report(out, sections, SECTIONS, provenance("speed.models_and_modules", argv))
    report.update({"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "machine": (torch.cuda.get_device_name() if device.type == "cuda" else
                               f"{os.uname().machine}, {os.cpu_count()} CPUs")})
    if "modules" in sections:
        peak_before = matmul_peak(device, repeats)
        modules = module_grid(device, repeats, [256, 1024] if args.quick else [256, 1024, 4096, 8192],
                              [64] if args.quick else [64, 256], peak_before)
        peak = max(peak_before, matmul_peak(device, repeats))
        for r in modules:  # fractions against the higher of the two peak measurements
            for key in ("fwd_peak_fraction", "fwd_bwd_peak_fraction"):
                r[key] *= peak_before / peak
        report.update(modules=modules, peak_gflops=peak / 1e9)
    if "moh" in sections:
        report["moh"] = moh_grid(device, repeats, [(512, 1)] if args.quick else [(512, 4), (2048, 1)])
    if "crossover" in sections:
        report["crossover"] = crossover(device, repeats, (32, 512) if args.quick else (32, 128, 512, 2048, 8192))
    for shape in ("small", "experts", "models"):
        if shape in sections:
            report[shape] = side_by_side(shape, device, 2 if args.quick else args.rounds, args.profile)
    write_result(out, report, markdown(report) + "\n\n" + runs_lines(report))


if __name__ == "__main__":
    main()
