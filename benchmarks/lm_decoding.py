"""Long-context decoding of the language models, against their ``transformer_lm`` twins.

    .venv/bin/python -m benchmarks.lm_decoding                       # every section
    .venv/bin/python -m benchmarks.lm_decoding --sections module crossover
    .venv/bin/python -m benchmarks.lm_decoding --quick               # a smoke run (the tests' check)

Sections (each row keyed by model id; the results carry the command, commit and versions):

* ``decode``: one decoding step (one new token per sentence, the whole model: embeddings, every
  layer, the output projection) after a context of --contexts tokens, at --batches sentences, for
  ``transformer_lm_small`` (fairseq's attention), ``moa_lm_small`` (4K8E64D), ``moh_lm_small`` at 75%
  (2 shared + top-1 of 2) and 50% (1 shared + top-1 of 3) of the heads, and the 50% model with every
  head computed (``moh-50-all-heads``: the same cache code, so it separates what skipping heads saves
  from what the cache saves). The cache of the context is filled with random keys and values of its
  real shape (a routed module's store as decoding grows it, an eighth of headroom); then --steps
  steps are timed. Models take turns within each of --rounds rounds; a figure is the median over
  rounds and steps, a ratio the median of the per-round ratios to the twin. Beside it, the K/V-cache
  bytes: what the cache holds and what its store has allocated.
* ``module``: the MoH paper's timing: one self-attention module of 32 heads of 64 (d_model 2048),
  forward only, 256 and 512 tokens of one sequence, fairseq's multi-head attention against MoH at 50%
  (8 shared + top-8 of 24) and 75% (8 shared + top-16 of 24) on its packed path, beside the multiply-
  add ratio (:func:`module_macs`) and the paper's published times.
* ``crossover``: one MoH decoding step of a module with every head against the routed heads packed
  (its ``all-heads`` and ``packed`` paths; it decodes on the first) by context length, at batch 1 and
  8, for the small and base shapes; and the attention of a decoding step's few queries as two matmuls
  against torch's fused kernel (which the modules use), by key count.
"""

import argparse
import json
import os
import statistics
import time

import torch
import moa  # noqa: F401  (registers the archs; imported before fairseq keeps fairseq's logging quiet)
from fairseq.modules.multihead_attention import MultiheadAttention
from benchmarks.common import RESULTS, provenance, provenance_line, write_atomically
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
            start = time.perf_counter()
            model(tokens, incremental_state=state)
            times.append(time.perf_counter() - start)
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
                       "ms_per_token": 1e3 * statistics.median(per_round[i]),
                       "kv_cache_mb": memory[i][0] / 2 ** 20, "kv_allocated_mb": memory[i][1] / 2 ** 20}
                if base:
                    row["time_ratio"] = statistics.median(a / b for a, b in zip(per_round[i], base))
                    row["kv_ratio"] = memory[i][0] / memory["transformer"][0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def module_macs(heads, active, head_dim, seq):
    """Forward multiply-adds per token of one self-attention module with ``active`` of ``heads`` heads
    computed on MoH's routed path: the active heads' queries and outputs, every head's keys and values
    (a later token may select any head), the router (heads + 2 logits), and attention over ``seq`` keys."""
    d = heads * head_dim
    router = d * (heads + 2) if active < heads else 0
    return 2 * active * head_dim * d + 2 * d * d + router + 2 * active * seq * head_dim


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
        times = {name: [] for name in modules}
        for _ in range(rounds):
            for name, module in modules.items():
                with torch.no_grad():
                    times[name].append(median_of(lambda: module(x, x, x, need_weights=False), repeats))
        for name in modules:
            macs = module_macs(heads, active[name], head_dim, seq) / module_macs(heads, heads, head_dim, seq)
            ratio = statistics.median(a / b for a, b in zip(times[name], times["mha"]))
            paper = PAPER_MS[seq].get(name)
            row = {"module_id": name, "seq": seq, "active_heads": active[name], "ms": 1e3 * statistics.median(times[name]),
                   "time_ratio": ratio, "macs_ratio": macs, "time_over_macs_ratio": ratio / macs,
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
    step = torch.randn(1, bsz, dim)

    def run():
        with torch.no_grad():
            module(step, step, step, incremental_state={key: dict(value) for key, value in state.items()},
                   need_weights=False)
    return run


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
                times = {"all-heads": [], "packed": []}
                for _ in range(rounds):
                    for path in times:
                        module.path = path
                        times[path].append(median_of(job, repeats))
                module.path = None
                row = {"module": name, "batch": bsz, "context": context,
                       "all_heads_ms": 1e3 * statistics.median(times["all-heads"]),
                       "packed_ms": 1e3 * statistics.median(times["packed"]),
                       "packed_over_all": statistics.median(a / b for a, b in zip(times["packed"], times["all-heads"]))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for bsz, heads in ((8, 4), (8, 12)):
        for keys in (16, 64, 256, 1024, 4096):
            q, k, v = torch.randn(bsz, heads, 1, 64), torch.randn(bsz, heads, keys, 64), torch.randn(bsz, heads, keys, 64)
            jobs = {"matmul": lambda: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125, -1), v),
                    "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
            times = {name: [] for name in jobs}
            for _ in range(rounds):
                for name, job in jobs.items():
                    times[name].append(median_of(job, repeats))
            row = {"attention": f"{bsz} sentences x {heads} heads, 1 query", "keys": keys,
                   "matmul_ms": 1e3 * statistics.median(times["matmul"]), "sdpa_ms": 1e3 * statistics.median(times["sdpa"]),
                   "matmul_over_sdpa": statistics.median(a / b for a, b in zip(times["matmul"], times["sdpa"]))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def median_of(job, repeats):
    job()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown(report):
    lines = ["# Long-context decoding of the language models (CPU)", ""]
    if report.get("decode"):
        lines += ["## One decoding step after a context (whole model), and the K/V cache", "",
                  "Per-token time: median over rounds and steps; ratio: median of the per-round ratios to "
                  "transformer_lm_small. K/V cache: what it holds (allocated: with the store's headroom).", "",
                  "| model | batch | context | ms/token | time ratio | K/V cache MB | K/V ratio | allocated MB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            lines.append(f"| {r['label']} | {r['batch']} | {r['context']:,} | {r['ms_per_token']:.2f} | "
                         f"{r.get('time_ratio', float('nan')):.2f} | {r['kv_cache_mb']:.1f} | "
                         f"{r.get('kv_ratio', float('nan')):.2f} | {r['kv_allocated_mb']:.1f} |")
    if report.get("module"):
        lines += ["", "## The MoH paper's module timing: 32 heads of 64, one sequence, forward only", "",
                  "| module | tokens | active heads | ms | time ratio | MACs ratio | time / MACs ratio | paper ms | paper ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in report["module"]:
            lines.append(f"| {r['module_id']} | {r['seq']} | {r['active_heads']} | {r['ms']:.3f} | {r['time_ratio']:.2f} | "
                         f"{r['macs_ratio']:.3f} | {r['time_over_macs_ratio']:.2f} | "
                         + (f"{r['paper_ms']:.3f} | {r['paper_ratio']:.2f} |" if r.get("paper_ms") else " | |"))
    if report.get("crossover"):
        lines += ["", "## Crossovers", "", "| MoH module | batch | context | every head ms | packed ms | ratio |",
                  "|---|---|---|---|---|---|"]
        for r in report["crossover"]:
            if "module" in r:
                lines.append(f"| {r['module']} | {r['batch']} | {r['context']:,} | {r['all_heads_ms']:.3f} | "
                             f"{r['packed_ms']:.3f} | {r['packed_over_all']:.2f} |")
        lines += ["", "| decoding-step attention | keys | two matmuls ms | fused SDPA ms | ratio |", "|---|---|---|---|---|"]
        for r in report["crossover"]:
            if "attention" in r:
                lines.append(f"| {r['attention']} | {r['keys']:,} | {r['matmul_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                             f"{r['matmul_over_sdpa']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_decoding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096, 8192])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed decoding steps per round")
    parser.add_argument("--quick", action="store_true", help="small contexts, 2 rounds: a smoke run")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/results/lm-decoding/cpu.json")
    args = parser.parse_args()
    contexts, rounds = ([64, 256], 2) if args.quick else (args.contexts, args.rounds)
    out = args.out or os.path.join(RESULTS, "lm-decoding", "cpu-quick.json" if args.quick else "cpu.json")
    report = {section: [] for section in SECTIONS}
    if set(args.sections) != set(SECTIONS) and os.path.exists(out):  # a partial run updates its sections only
        with open(out) as f:
            report.update(json.load(f))
    report.setdefault("runs", {})
    run = provenance("lm_decoding")
    report["runs"].update({section: run for section in args.sections})
    report["threads"] = torch.get_num_threads()
    if "decode" in args.sections:
        report["decode"] = decode_section(contexts, args.batches, rounds, 2 if args.quick else args.steps, args.models)
    if "module" in args.sections:
        report["module"] = module_section([256] if args.quick else [256, 512], rounds, 3 if args.quick else 9)
    if "crossover" in args.sections:
        report["crossover"] = crossover_section([64, 256] if args.quick else [64, 128, 256, 512, 1024, 2048, 4096],
                                                rounds, 3 if args.quick else 9)
    text = markdown(report) + "\n\n" + "\n".join(f"- {section}: {provenance_line(r)}"
                                                 for section, r in report["runs"].items())
    print("\n" + text)
    write_atomically(out, json.dumps(report, indent=1))
    write_atomically(os.path.splitext(out)[0] + ".md", text + "\n")


if __name__ == "__main__":
    main()
