"""MoA and MoH speed and memory, side by side with fairseq's multi-head attention, in one run.

    .venv/bin/python -m benchmarks.moa_speed                # full run
    .venv/bin/python -m benchmarks.moa_speed --quick        # a smaller grid, for a smoke test
    .venv/bin/python -m benchmarks.moa_speed --device cuda  # the same on a GPU

Prints a markdown report and writes it with the raw figures as JSON, each section with the command,
commit and versions that measured it (``--out``, default benchmarks/results/speed/<device>.json and .md). Timings are
medians of --repeats runs after warm-up. FLOPs are counted analytically
(router, selected-expert Q, shared K/V, q K^T and attention @ V, selected-expert O;
backward = 2x forward) and compared with a float32 matmul peak measured in
the same run (median of 2048^3 matmuls, before and after the module grid).

The MoH section times one self-attention module of 16 heads of 64 (d_model 1024) at 75% (8 shared
+ top-4 of 8) and 50% (4 shared + top-4 of 12) of the heads active, and the same modules computing
every head and multiplying by the gates (the released code's dense-masked path), against fairseq's
16x64 multi-head attention, at 512 and 2048 tokens per sequence. The modules are timed in turn,
round after round, and each ratio is a median over rounds; MACs are counted analytically (K/V stay
dense: per token 2 C^2 for K and V, 2 a C^2 for Q and O, 2 a T C for the attention core, at an
active fraction a).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import moa  # noqa: F401  (registers the plugin)
from benchmarks.authors_style_moa import AuthorsStyleMoA
from benchmarks.common import RESULTS, provenance, provenance_line, write_atomically
from fairseq.modules.multihead_attention import MultiheadAttention
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.models.build import build_translation_model, dictionary_of_size

D_MODEL = 512
MOA_CONFIGS = {"8K8E128D": (8, 8, 128), "16K32E256D": (32, 16, 256), "2K8E64D": (8, 2, 64), "4K16E64D": (16, 4, 64)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(device, repeats):
    a, b = (torch.randn(2048, 2048, device=device) for _ in range(2))
    return 2 * 2048 ** 3 / median_time(lambda: a @ b, device, max(repeats, 5))


def forward_flops(name, tokens, bsz, seq):
    """Analytic forward FLOPs of one self-attention module over tokens = bsz * seq."""
    if name == "MHA 8x64":
        return 4 * 2 * tokens * D_MODEL * D_MODEL + 2 * 2 * bsz * 8 * seq * seq * 64
    experts, k, head = MOA_CONFIGS[name]
    return (2 * tokens * D_MODEL * experts + 2 * 2 * tokens * k * D_MODEL * head
            + 2 * 2 * tokens * D_MODEL * head + 2 * 2 * bsz * k * seq * seq * head)


def make_module(name, device):
    torch.manual_seed(0)
    if name == "MHA 8x64":
        return MultiheadAttention(D_MODEL, 8, self_attention=True).to(device)
    experts, k, head = MOA_CONFIGS[name]
    return MixtureOfAttentionHeads(D_MODEL, experts, k, head, self_attention=True).to(device)


def run_module(module, x, backward):
    out = module(x, x, x, need_weights=False)[0] if not isinstance(module, AuthorsStyleMoA) else module(x)
    if backward:
        out.sum().backward()


def compute_floor(module, x, bsz, seq):
    """The same GEMMs and attention kernel on ready-made contiguous inputs, forward and backward:
    what the module would cost if routing, grouping, scatter and gating were free."""
    m, dim = module, D_MODEL
    flat = x.detach().reshape(-1, dim)
    with torch.no_grad():
        experts = m.router(flat).selected
    sizes = torch.bincount(experts.flatten(), minlength=m.num_experts).tolist()
    dense = m.top_k == m.num_experts
    leaf = lambda *shape: torch.randn(*shape, device=x.device, requires_grad=True)  # noqa: E731
    rows_q = [leaf(n, dim) for n in sizes]
    rows_o = [leaf(n, m.head_dim) for n in sizes]
    kv_in, q_in = leaf(flat.size(0), dim), leaf(bsz, m.top_k, seq, m.head_dim)

    def step():
        if dense:
            outs = [kv_in @ m.q_experts.weight.view(dim, -1),
                    leaf(flat.size(0), m.num_experts * m.head_dim) @ m.o_experts.weight.reshape(-1, dim)]
        else:
            wq, wo = m.q_experts.weight.unbind(1), m.o_experts.weight.unbind(0)
            outs = [r @ w for r, w in zip(rows_q, wq)] + [r @ w for r, w in zip(rows_o, wo)]
        keys = m.k_proj(kv_in).view(bsz, 1, seq, m.head_dim)
        values = m.v_proj(kv_in).view(bsz, 1, seq, m.head_dim)
        outs.append(F.scaled_dot_product_attention(q_in, keys, values, enable_gqa=True))
        sum(o.sum() for o in outs).backward()

    return step


def module_grid(device, repeats, token_counts, seq_lens, peak):
    rows = []
    names = ["MHA 8x64", *MOA_CONFIGS]
    for seq in seq_lens:
        for tokens in token_counts:
            if tokens < seq:
                continue
            bsz = tokens // seq
            x = torch.randn(seq, bsz, D_MODEL, device=device, requires_grad=True)
            for name in names:
                module = make_module(name, device)
                row = {"module": name, "tokens": tokens, "seq_len": seq, "batch": bsz}
                for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                    ctx = torch.no_grad() if not backward else torch.enable_grad()
                    with ctx:
                        seconds = median_time(lambda: run_module(module, x, backward), device, repeats)
                    flops = forward_flops(name, tokens, bsz, seq) * (3 if backward else 1)
                    row[f"{mode}_ms"] = seconds * 1e3
                    row[f"{mode}_peak_fraction"] = flops / seconds / peak
                if name != "MHA 8x64":
                    floor = median_time(compute_floor(module, x, bsz, seq), device, repeats)
                    row["fwd_bwd_overhead_fraction"] = 1 - floor / (row["fwd_bwd_ms"] / 1e3)
                    if name in ("8K8E128D", "16K32E256D") and tokens == 1024 and seq == 64:
                        authors = AuthorsStyleMoA(module)
                        row["authors_style_fwd_bwd_ms"] = 1e3 * median_time(
                            lambda: run_module(authors, x, True), device, repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


SECTIONS = ("modules", "moh", "models")
MOH_D_MODEL, MOH_HEADS = 1024, 16
MOH_CONFIGS = {"MoH 75% (8 + top-4 of 8)": (8, 4), "MoH 50% (4 + top-4 of 12)": (4, 4)}


def moh_macs_per_token(active_fraction, seq):
    """Forward MACs per token of one self-attention module at ``active_fraction`` of its heads."""
    c = MOH_D_MODEL
    return 2 * c * c + 2 * active_fraction * c * c + 2 * active_fraction * seq * c


def moh_grid(device, repeats, shapes):
    """MoH against fairseq's MHA of the same shape; ``shapes``: (seq_len, batch) pairs."""
    torch.manual_seed(0)
    modules = {"MHA 16x64": MultiheadAttention(MOH_D_MODEL, MOH_HEADS, self_attention=True).to(device)}
    for name, (shared, top_k) in MOH_CONFIGS.items():
        modules[name] = MixtureOfHeadsAttention(MOH_D_MODEL, MOH_HEADS, shared, top_k, self_attention=True).to(device)
        dense = MixtureOfHeadsAttention(MOH_D_MODEL, MOH_HEADS, shared, top_k, self_attention=True).to(device)
        dense.load_state_dict(modules[name].state_dict())
        dense.compute_all_heads = True
        modules[name + ", dense-masked"] = dense
    rows = []
    for seq, bsz in shapes:
        x = torch.randn(seq, bsz, MOH_D_MODEL, device=device, requires_grad=True)
        times = {(name, mode): [] for name in modules for mode in ("fwd", "fwd_bwd")}
        for _ in range(repeats + 1):  # the first round warms up
            for name, module in modules.items():
                for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                    with (torch.enable_grad() if backward else torch.no_grad()):
                        times[(name, mode)].append(median_time(lambda: run_module(module, x, backward), device, 1,
                                                               warmup=0))
        for name, module in modules.items():
            fraction = 1.0 if name.startswith("MHA") else module.router.active_fraction
            row = {"module": name, "seq_len": seq, "batch": bsz, "active_fraction": fraction,
                   "macs_ratio": moh_macs_per_token(fraction, seq) / moh_macs_per_token(1.0, seq)}
            for mode in ("fwd", "fwd_bwd"):
                own, mha = times[(name, mode)][1:], times[("MHA 16x64", mode)][1:]
                row[f"{mode}_ms"] = 1e3 * statistics.median(own)
                row[f"{mode}_ratio"] = statistics.median(a / b for a, b in zip(own, mha))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


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


def synthetic_batch(model, bsz, src_len, tgt_len, device):
    g = torch.Generator().manual_seed(0)
    vocab = len(model.decoder.dictionary)
    src = torch.randint(4, vocab, (bsz, src_len), generator=g).to(device)
    target = torch.randint(4, vocab, (bsz, tgt_len), generator=g).to(device)
    prev = torch.roll(target, 1, dims=1)
    prev[:, 0] = model.decoder.dictionary.eos()
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), src_len, device=device),
                          "prev_output_tokens": prev}, "target": target, "ntokens": bsz * tgt_len,
            "nsentences": bsz}


def criterion_for(model, arch):
    from fairseq.criterions import CRITERION_REGISTRY

    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    name = "moa_label_smoothed_cross_entropy" if arch.startswith(("moa", "moh")) else "label_smoothed_cross_entropy"
    return CRITERION_REGISTRY[name](task, sentence_avg=False, label_smoothing=0.1)


def train_step_fn(arch, device, bsz, length):
    model = build_translation_model(arch, dictionary_of_size(32768)).to(device).train()
    criterion = criterion_for(model, arch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    sample = synthetic_batch(model, bsz, length, length, device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        optimizer.step()

    return model, sample, step


def model_level(device, repeats, archs, bsz=64, length=32, beam_batch=16):
    from fairseq.sequence_generator import SequenceGenerator

    rows = []
    for arch in archs:
        model, sample, step = train_step_fn(arch, device, bsz, length)
        seconds = median_time(step, device, repeats, warmup=1)
        src = sample["net_input"]["src_tokens"][:beam_batch]
        generator = SequenceGenerator([model.eval()], model.decoder.dictionary, beam_size=4, max_len_a=0,
                                      max_len_b=length, min_len=length)
        batch = {"net_input": {"src_tokens": src, "src_lengths": torch.full((beam_batch,), length, device=device)}}
        with torch.no_grad():
            beam_seconds = median_time(lambda: generator.generate([model], batch), device, repeats, warmup=1)
        row = {"arch": arch, "parameters": sum(p.numel() for p in model.parameters()),
               "train_words_per_s": sample["ntokens"] / seconds, "train_step_ms": seconds * 1e3,
               "beam4_sentences_per_s": beam_batch / beam_seconds,
               "kv_cache_bytes_per_token_per_layer": kv_cache_bytes_per_token_layer(model, device),
               "peak_train_memory_mb": peak_train_memory(arch, device, bsz, length)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def peak_train_memory(arch, device, bsz, length):
    """Peak memory of three training steps, in a fresh process (CPU: peak RSS; CUDA: max allocated)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", arch,
                          "--device", device.type, "--batch", str(bsz), "--length", str(length)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def memory_child(arch, device, bsz, length):
    _, _, step = train_step_fn(arch, device, bsz, length)
    for _ in range(3):
        step()
    if device.type == "cuda":
        print(torch.cuda.max_memory_allocated() / 2 ** 20)
    else:
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def markdown(report):
    dates = ", ".join(f"{name} {date}" for name, date in report["dates"].items())
    lines = [f"MoA and MoH benchmark, {report['machine']}, torch {report['torch']}, {report['threads']} threads "
             f"(measured: {dates})."
             + (f" Matmul peak (float32 2048^3): {report['peak_gflops']:.0f} GFLOP/s." if "peak_gflops" in report else ""),
             "",
             "| module | tokens | seq | fwd ms | fwd+bwd ms | fwd+bwd % of peak | vs MHA (fwd+bwd) | overhead | "
             "authors-style fwd+bwd ms | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    mha = {(r["tokens"], r["seq_len"]): r for r in report["modules"] if r["module"] == "MHA 8x64"}
    for r in report["modules"]:
        base = mha[(r["tokens"], r["seq_len"])]["fwd_bwd_ms"]
        overhead = f"{100 * r['fwd_bwd_overhead_fraction']:.0f}%" if "fwd_bwd_overhead_fraction" in r else ""
        authors = r.get("authors_style_fwd_bwd_ms")
        lines.append(f"| {r['module']} | {r['tokens']} | {r['seq_len']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{100 * r['fwd_bwd_peak_fraction']:.0f}% | {r['fwd_bwd_ms'] / base:.2f}x | {overhead} | "
                     + (f"{authors:.1f} | {authors / r['fwd_bwd_ms']:.2f}x |" if authors else " | |"))
    if report.get("models"):
        lines += ["", "| arch | parameters | train words/s | beam-4 sentences/s | K/V cache bytes/token/layer | "
                  "peak train memory MB |", "|---|---|---|---|---|---|"]
        for r in report["models"]:
            lines.append(f"| {r['arch']} | {r['parameters']:,} | {r['train_words_per_s']:.0f} | "
                         f"{r['beam4_sentences_per_s']:.2f} | {r['kv_cache_bytes_per_token_per_layer']:.0f} | "
                         f"{r['peak_train_memory_mb']:.0f} |")
    if report.get("moh"):
        lines += ["", "| MoH module (d_model 1024, 16x64) | seq x batch | active heads | MACs ratio | fwd ms | fwd ratio | "
                  "fwd+bwd ms | fwd+bwd ratio | fwd+bwd ratio / MACs ratio |", "|---|---|---|---|---|---|---|---|---|"]
        for r in report["moh"]:
            lines.append(f"| {r['module']} | {r['seq_len']}x{r['batch']} | {100 * r['active_fraction']:.0f}% | "
                         f"{r['macs_ratio']:.2f} | {r['fwd_ms']:.1f} | {r['fwd_ratio']:.2f} | {r['fwd_bwd_ms']:.1f} | "
                         f"{r['fwd_bwd_ratio']:.2f} | {r['fwd_bwd_ratio'] / r['macs_ratio']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moa_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a few shapes and 2 repeats, no model level")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which sections to run (default: all); a partial run replaces those sections of an "
                             "existing --out file and keeps the others, each section with its date")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/results/speed/<device>.json")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.memory_child:
        return memory_child(args.memory_child, device, args.batch, args.length)

    repeats = 2 if args.quick else args.repeats
    tokens = [256, 1024] if args.quick else [256, 1024, 4096, 8192]
    seqs = [64] if args.quick else [64, 256]
    out = args.out or os.path.join(RESULTS, "speed", f"{device.type}{'-quick' if args.quick else ''}.json")
    report = {"modules": [], "moh": [], "models": [], "dates": {}, "runs": {}}
    if set(args.sections) != set(SECTIONS) and os.path.exists(out):  # a partial run updates its sections only
        with open(out) as f:
            report.update(json.load(f))
    report.update({"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "machine": (torch.cuda.get_device_name() if device.type == "cuda"
                               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")})
    today = time.strftime("%Y-%m-%d")
    run = provenance("moa_speed")
    report["runs"].update({section: run for section in args.sections if section != "models" or not args.quick})
    if "modules" in args.sections:
        peak_before = matmul_peak(device, repeats)
        modules = module_grid(device, repeats, tokens, seqs, peak_before)
        peak = max(peak_before, matmul_peak(device, repeats))
        for r in modules:  # fractions against the higher of the two peak measurements
            for key in ("fwd_peak_fraction", "fwd_bwd_peak_fraction"):
                r[key] *= peak_before / peak
        report.update(modules=modules, peak_gflops=peak / 1e9)
        report["dates"]["modules"] = today
    if "moh" in args.sections:
        report["moh"] = moh_grid(device, repeats, [(512, 1)] if args.quick else [(512, 4), (2048, 1)])
        report["dates"]["moh"] = today
    if "models" in args.sections and not args.quick:
        report["models"] = model_level(device, 3, ["transformer_wmt_en_de", "moa_base", "moh_base"])
        report["dates"]["models"] = today
    text = markdown(report) + "\n\n" + "\n".join(
        f"- {section}: {provenance_line(section_run)}" for section, section_run in report["runs"].items())
    print("\n" + text)
    write_atomically(out, json.dumps(report, indent=1))
    write_atomically(os.path.splitext(out)[0] + ".md", text + "\n")


if __name__ == "__main__":
    main()
