"""Long-context decoding of the language models, against their ``transformer_lm`` twins.

    .venv/bin/python -m benchmarks.speed.lm_decoding                       # every section
    .venv/bin/python -m benchmarks.speed.lm_decoding --sections module crossover
    .venv/bin/python -m benchmarks.speed.lm_decoding --quick               # a smoke run (the tests' check)

Sections: ``decode`` (one decoding step of whole LMs after --contexts cached tokens, and the K/V cache),
``module`` (the MoH paper's module timing, 32 heads of 64, beside its published times), ``crossover``
(MoH's decoding paths by context length; two matmuls against the fused attention kernel).
What each measures: benchmarks/speed/README.md.
"""

import json
import statistics

import torch
import moa  # noqa: F401  (registers the archs; imported before fairseq keeps fairseq's logging quiet)
from benchmarks.harness.macs import moh_module_macs
from benchmarks.harness.models import cached_attention_step
from benchmarks.harness.results import (provenance, runs_lines, sectioned_report, study_parser, study_results, table,
                                        write_result)
from benchmarks.harness.timing import interleaved, ms, ratio, seconds
from fairseq.modules.multihead_attention import MultiheadAttention
from moa import routed_attention
from moa.models.build import build_from_args, dictionary_of_size, model_args
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routed_attention import STORE, RoutedAttention

SECTIONS = ("decode", "module", "crossover")
VOCABULARY = 8000
MODELS = {  # id: (label, arch, flags, module settings)
    "transformer": ("transformer_lm_small (4 heads of 64)", "transformer_lm_small", [], {}),
    "moa": ("moa_lm_small (4K8E64D)", "moa_lm_small", [], {}),
    "moh-75": ("moh_lm_small, 2 shared + top-1 of 2 (75%)", "moh_lm_small", [], {}),
    "moh-50": ("moh_lm_small, 1 shared + top-1 of 3 (50%)", "moh_lm_small",
               ["--moh-shared-heads", "1", "--moh-top-k", "1"], {}),
    "moh-50-all-heads": ("the same, every head computed", "moh_lm_small", ["--moh-shared-heads", "1", "--moh-top-k", "1"],
                         {"path": "all-heads"}),
    "switchhead": ("switchhead_lm_small (2H2K4E56D)", "switchhead_lm_small", [], {}),
}
PAPER_MS = {256: {"mha": 0.360, "moh-50": 0.225, "moh-75": 0.321}, 512: {"mha": 1.376, "moh-50": 0.863, "moh-75": 1.180}}


def build_lm(arch, flags, settings, max_positions):
    torch.manual_seed(0)
    args = model_args(arch, flags)
    args.tokens_per_sample = args.max_target_positions = max_positions
    model = build_from_args(args, dictionary_of_size(VOCABULARY)).eval()
    for module in model.modules():
        for name, value in settings.items():
            if hasattr(module, name):
                setattr(module, name, value)
    return model


def filled_state(model, bsz, context):
    """An incremental state whose every self-attention cache holds ``context`` random positions."""
    state = {}
    with torch.no_grad():
        model(torch.randint(4, VOCABULARY, (bsz, 1)), incremental_state=state)
    for layer in model.decoder.layers:
        attn = layer.self_attn
        buffer = attn._get_input_buffer(state)
        time_dim = attn.time_dim if isinstance(attn, RoutedAttention) else 2
        for name in ("prev_key", "prev_value"):
            if isinstance(attn, RoutedAttention):  # as a store grown step by step holds it
                fill_store(buffer, name, time_dim, context,
                           routed_attention.store_capacity(context) - context)
            else:
                shape = list(buffer[name].shape)
                shape[time_dim] = context
                buffer[name] = torch.randn(shape)
        buffer["prev_key_padding_mask"] = None
        attn._set_input_buffer(state, buffer)
    return state


def fill_store(buffer, name, time_dim, context, headroom):
    """Make ``buffer[name]`` ``context`` random positions at the front of a store with ``headroom`` more."""
    shape = list(buffer[name].shape)
    shape[time_dim] = context + headroom
    buffer[name + STORE] = torch.randn(shape)
    buffer[name] = buffer[name + STORE].narrow(time_dim, 0, context)


def cache_bytes(model, state):
    """(held, allocated) bytes of every layer's key/value cache."""
    held = allocated = 0
    for layer in model.decoder.layers:
        buffer = layer.self_attn._get_input_buffer(state)
        for name in ("prev_key", "prev_value"):
            size = buffer[name].numel() * buffer[name].element_size()
            held += size
            store = buffer.get(name + STORE)
            allocated += size if store is None else store.numel() * store.element_size()
    return held, allocated


def step_times(model, bsz, context, steps):
    """Seconds of each of ``steps`` decoding steps after ``context`` cached positions (one warm-up first)."""
    state = filled_state(model, bsz, context)
    times = []
    with torch.no_grad():
        for i in range(steps + 1):
            tokens = torch.randint(4, VOCABULARY, (bsz, context + 1 + i))
            times.append(seconds(lambda: model(tokens, incremental_state=state)))
    held, allocated = cache_bytes(model, state)
    return times[1:], held, allocated


def decode_section(contexts, batches, rounds, steps, model_ids):
    models = {i: build_lm(*MODELS[i][1:], max_positions=max(contexts) + steps + 8) for i in model_ids}
    rows = []
    for bsz in batches:
        for context in contexts:
            per_round = {i: [] for i in model_ids}
            memory = {}
            for _ in range(rounds):
                for i in model_ids:
                    times, held, allocated = step_times(models[i], bsz, context, steps)
                    per_round[i].append(statistics.median(times))
                    memory[i] = (held, allocated)
            base = per_round.get("transformer")
            for i in model_ids:
                row = {"model_id": i, "label": MODELS[i][0], "batch": bsz, "context": context,
                       "ms_per_token": ms(per_round[i]),
                       "kv_cache_mb": memory[i][0] / 2 ** 20, "kv_allocated_mb": memory[i][1] / 2 ** 20}
                if base:
                    row["time_ratio"] = ratio(per_round[i], base)
                    row["kv_ratio"] = memory[i][0] / memory["transformer"][0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def module_section(seqs, rounds, repeats):
    heads, head_dim = 32, 64
    d = heads * head_dim
    torch.manual_seed(0)
    modules = {"mha": MultiheadAttention(d, heads, self_attention=True).eval(),
               "moh-50": MixtureOfHeadsAttention(d, heads, 8, 8, self_attention=True).eval(),
               "moh-75": MixtureOfHeadsAttention(d, heads, 8, 16, self_attention=True).eval()}
    for name in ("moh-50", "moh-75"):
        modules[name].path = "packed"  # the routed heads' work only, at every size
        for p in modules[name].router.parameters():
            torch.nn.init.normal_(p, std=d ** -0.5)
    active = {"mha": heads, "moh-50": 16, "moh-75": 24}
    rows = []
    for seq in seqs:
        x = torch.randn(seq, 1, d)
        with torch.no_grad():
            times = interleaved({name: (lambda m=module: m(x, x, x, need_weights=False)) for name, module in modules.items()},
                                rounds, repeats=repeats)
        for name in modules:
            macs = moh_module_macs(d, heads, active[name], seq) / moh_module_macs(d, heads, heads, seq)
            time_ratio = ratio(times[name], times["mha"])
            paper = PAPER_MS[seq].get(name)
            row = {"module_id": name, "seq": seq, "active_heads": active[name], "ms": ms(times[name]),
                   "time_ratio": time_ratio, "macs_ratio": macs, "time_over_macs_ratio": time_ratio / macs,
                   "paper_ms": paper, "paper_ratio": paper and paper / PAPER_MS[seq]["mha"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def decode_step_job(module, bsz, context):
    """One decoding step of ``module`` after ``context`` cached random positions, from the same cache each time."""
    dim = module.embed_dim
    state = {}
    with torch.no_grad():
        x = torch.randn(1, bsz, dim)
        module(x, x, x, incremental_state=state, need_weights=False)
    buffer = module._get_input_buffer(state)
    for name in ("prev_key", "prev_value"):
        fill_store(buffer, name, module.time_dim, context, 64)
    module._set_input_buffer(state, buffer)
    return cached_attention_step(module, state, torch.randn(1, bsz, dim))


def crossover_section(contexts, rounds, repeats):
    rows = []
    shapes = {"MoH d 256, 4 heads, 1 shared + top-1 of 3": (256, 4, 1, 1),
              "MoH d 768, 12 heads, 3 shared + top-3 of 9": (768, 12, 3, 3)}
    for name, (dim, heads, shared, top_k) in shapes.items():
        torch.manual_seed(0)
        module = MixtureOfHeadsAttention(dim, heads, shared, top_k, self_attention=True).eval()
        for p in module.router.parameters():
            torch.nn.init.normal_(p, std=dim ** -0.5)
        for bsz in (1, 8):
            for context in contexts:
                job = decode_step_job(module, bsz, context)
                times = interleaved({path: (lambda p=path: (setattr(module, "path", p), job()))
                                     for path in ("all-heads", "packed")}, rounds, repeats=repeats)
                module.path = None
                row = {"module": name, "batch": bsz, "context": context, "all_heads_ms": ms(times["all-heads"]),
                       "packed_ms": ms(times["packed"]), "packed_over_all": ratio(times["packed"], times["all-heads"])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for bsz, heads in ((8, 4), (8, 12)):
        for keys in (16, 64, 256, 1024, 4096):
            q, k, v = torch.randn(bsz, heads, 1, 64), torch.randn(bsz, heads, keys, 64), torch.randn(bsz, heads, keys, 64)
            jobs = {"matmul": lambda: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125, -1), v),
                    "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
            times = interleaved(jobs, rounds, repeats=repeats)
            row = {"attention": f"{bsz} sentences x {heads} heads, 1 query", "keys": keys, "matmul_ms": ms(times["matmul"]),
                   "sdpa_ms": ms(times["sdpa"]), "matmul_over_sdpa": ratio(times["matmul"], times["sdpa"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(report):
    lines = ["# Long-context decoding of the language models (CPU)"]
    if report.get("decode"):
        lines += ["", "## One decoding step after a context (whole model), and the K/V cache", "",
                  "Per-token time: median over rounds and steps; ratio: median of the per-round ratios to "
                  "transformer_lm_small. K/V cache: what it holds (allocated: with the store's headroom).", ""]
        lines += table(["model", "batch", "context", "ms/token", "time ratio", "K/V cache MB", "K/V ratio", "allocated MB"],
                       [[r["label"], r["batch"], f"{r['context']:,}", f"{r['ms_per_token']:.2f}",
                         f"{r.get('time_ratio', float('nan')):.2f}", f"{r['kv_cache_mb']:.1f}",
                         f"{r.get('kv_ratio', float('nan')):.2f}", f"{r['kv_allocated_mb']:.1f}"] for r in report["decode"]])
    if report.get("module"):
        lines += ["", "## The MoH paper's module timing: 32 heads of 64, one sequence, forward only", ""]
        lines += table(["module", "tokens", "active heads", "ms", "time ratio", "MACs ratio", "time / MACs ratio",
                        "paper ms", "paper ratio"],
                       [[r["module_id"], r["seq"], r["active_heads"], f"{r['ms']:.3f}", f"{r['time_ratio']:.2f}",
                         f"{r['macs_ratio']:.3f}", f"{r['time_over_macs_ratio']:.2f}",
                         f"{r['paper_ms']:.3f}" if r.get("paper_ms") else "",
                         f"{r['paper_ratio']:.2f}" if r.get("paper_ms") else ""] for r in report["module"]])
    if report.get("crossover"):
        lines += ["", "## Crossovers", ""]
        lines += table(["MoH module", "batch", "context", "every head ms", "packed ms", "ratio"],
                       [[r["module"], r["batch"], f"{r['context']:,}", f"{r['all_heads_ms']:.3f}", f"{r['packed_ms']:.3f}",
                         f"{r['packed_over_all']:.2f}"] for r in report["crossover"] if "module" in r])
        lines += [""] + table(["decoding-step attention", "keys", "two matmuls ms", "fused SDPA ms", "ratio"],
                              [[r["attention"], f"{r['keys']:,}", f"{r['matmul_ms']:.3f}", f"{r['sdpa_ms']:.3f}",
                                f"{r['matmul_over_sdpa']:.2f}"] for r in report["crossover"] if "attention" in r])
    return "\n".join(lines)


def main(argv=None):
    parser = study_parser("speed.lm_decoding", __doc__)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096, 8192])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed decoding steps per round")
    parser.add_argument("--quick", action="store_true", help="small contexts, 2 rounds: a smoke run")
    parser.add_argument("--out", help="JSON path (a .md beside it); default results/lm-decoding/cpu.json")
    args = parser.parse_args(argv)
    contexts, rounds, repeats = ([64, 256], 2, 3) if args.quick else (args.contexts, args.rounds, 9)
    out = args.out or study_results("speed", "lm-decoding", "cpu-quick.json" if args.quick else "cpu.json")
    report = sectioned_report(out, args.sections, SECTIONS, provenance("speed.lm_decoding", argv))
    report["threads"] = torch.get_num_threads()
    if "decode" in args.sections:
        report["decode"] = decode_section(contexts, args.batches, rounds, 2 if args.quick else args.steps, args.models)
    if "module" in args.sections:
        report["module"] = module_section([256] if args.quick else [256, 512], rounds, repeats)
    if "crossover" in args.sections:
        report["crossover"] = crossover_section([64, 256] if args.quick else [64, 128, 256, 512, 1024, 2048, 4096],
                                                rounds, repeats)
    write_result(out, report, markdown(report) + "\n\n" + runs_lines(report))


if __name__ == "__main__":
    main()
