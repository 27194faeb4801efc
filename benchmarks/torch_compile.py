"""Does torch.compile of the routed attention modules pay on this machine? Eager against compiled, side by side.

    .venv/bin/python -m benchmarks.torch_compile [--dtype bfloat16]   # about 10 minutes on 2 cores, most compiling

At the Multi30k shape (benchmarks.moa_speed's ``small`` section), for ``moa_small`` and ``moh_small``:
one training step (criterion, backward) on 128 x 16 tokens and beam-4 decoding of 32 sentences forced to
16 tokens, with every routed attention module compiled as ``--compile-routed-attention`` compiles it
(moa.routed_attention.compile_routed_attention) against the same model eager. The first call (which compiles) is reported apart; then medians of
interleaved rounds. The compiler's cache starts empty (a fresh ``TORCHINDUCTOR_CACHE_DIR``), so the
compile time is what a first run pays.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch._dynamo.utils import counters

import moa  # noqa: F401  (registers the plugin)
from benchmarks.common import RESULTS, provenance, provenance_line, write_atomically
from benchmarks.moa_speed import beam_decode, criterion_for, shape_model, synthetic_batch
from moa.routed_attention import compile_routed_attention


def build(arch, compiled, dtype):
    model = shape_model("small", arch, torch.device("cpu")).to(dtype)
    if compiled:
        compile_routed_attention(model)
    return model


def job(model, arch, kind):
    sample = synthetic_batch(model, 128, 16, 16, "cpu")
    if kind == "decode":
        return beam_decode(model, sample, 32, 16)
    criterion = criterion_for(model, arch)

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        criterion(model, sample)[0].backward()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["moa_small", "moh_small"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", help="default benchmarks/results/torch-compile/cpu-DTYPE.json")
    args = parser.parse_args(argv)
    args.out = args.out or os.path.join(RESULTS, "torch-compile", f"cpu-{args.dtype}.json")
    dtype = getattr(torch, args.dtype)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="moa-inductor-"))  # compile afresh
    rows = []
    for arch in args.models:
        counters.clear()
        torch._dynamo.reset()
        models = {compiled: build(arch, compiled, dtype) for compiled in (False, True)}
        for kind in ("train", "decode"):
            runs, first = {}, {}
            try:
                for compiled, model in models.items():
                    runs[compiled] = job(model, arch, kind)
                    start = time.perf_counter()
                    runs[compiled]()
                    first[compiled] = time.perf_counter() - start
            except Exception as error:  # the compiler's failure is the result
                row = {"model": arch, "job": kind, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            times = {compiled: [] for compiled in runs}
            for _ in range(args.rounds):
                for compiled, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[compiled].append(time.perf_counter() - start)
            row = {"model": arch, "job": kind, "eager_ms": 1e3 * statistics.median(times[False]),
                   "compiled_ms": 1e3 * statistics.median(times[True]),
                   "compiled_over_eager": statistics.median(c / e for e, c in zip(times[False], times[True])),
                   "first_call_eager_s": first[False], "first_call_compiled_s": first[True]}
            row["graphs"] = counters["stats"]["unique_graphs"]  # compiled so far for this model
            row["graph_breaks"] = sum(counters["graph_break"].values())
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"# torch.compile of the routed attention modules (CPU, {args.dtype})", "",
             "| model | job | eager ms | compiled ms | compiled / eager | first call eager s | first call compiled s "
             "| graphs | graph breaks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['job']} | | | compiled fails: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['job']} | {r['eager_ms']:.0f} | {r['compiled_ms']:.0f} | "
                     f"{r['compiled_over_eager']:.2f}x | {r['first_call_eager_s']:.1f} | {r['first_call_compiled_s']:.1f} | "
                     f"{r['graphs']} | {r['graph_breaks']} |")
    run = provenance("torch_compile", argv)
    text = "\n".join(lines) + "\n\n" + provenance_line(run)
    print("\n" + text)
    write_atomically(args.out, json.dumps({"run": run, "rows": rows}, indent=1))
    write_atomically(os.path.splitext(args.out)[0] + ".md", text + "\n")


if __name__ == "__main__":
    main()
