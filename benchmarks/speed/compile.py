"""Does torch.compile of the routed attention modules pay on this machine? Eager against compiled, side by side.

    .venv/bin/python -m benchmarks.speed.compile [--dtype bfloat16]   # about 10 minutes on 2 cores, most compiling
    .venv/bin/python -m benchmarks.speed.compile --quick              # moa_small's training step, 1 round

At the Multi30k shape, for ``moa_small`` and ``moh_small``: one training step on 128 x 16 tokens and beam-4
decoding of 32 sentences forced to 16 tokens, every routed attention module compiled as
``--compile-routed-attention`` compiles it, against the same model eager. The first call (which compiles,
from an empty cache) is reported apart; then medians of interleaved rounds.
"""

import json
import os
import tempfile

import torch
from torch._dynamo.utils import counters

from benchmarks.harness.models import beam_decode, shape_model, synthetic_batch, train_step
from benchmarks.harness.results import provenance, provenance_line, study_parser, study_results, table, write_result
from benchmarks.harness.timing import interleaved, ms, ratio, seconds
from moa.routed_attention import compile_routed_attention


def job(arch, compiled, dtype, kind):
    model = shape_model("small", arch).to(dtype)
    if compiled:
        compile_routed_attention(model)
    sample = synthetic_batch(model, 128, 16, 16)
    return beam_decode(model, sample, 32, 16) if kind == "decode" else train_step(model, arch, sample, optimizer=False)


def main(argv=None):
    parser = study_parser("speed.compile", __doc__)
    parser.add_argument("--models", nargs="+", default=["moa_small", "moh_small"])
    parser.add_argument("--jobs", nargs="+", choices=["train", "decode"], default=["train", "decode"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="moa_small's training step, one round: a smoke run")
    parser.add_argument("--out", help="default results/torch-compile/cpu-DTYPE.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.jobs, args.rounds = ["moa_small"], ["train"], 1
    out = args.out or study_results("speed", "torch-compile", f"cpu-{args.dtype}{'-quick' if args.quick else ''}.json")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="moa-inductor-"))  # compile afresh
    rows = []
    for arch in args.models:
        counters.clear()
        torch._dynamo.reset()
        for kind in args.jobs:
            runs, first = {}, {}
            try:
                for compiled in (False, True):
                    runs[compiled] = job(arch, compiled, getattr(torch, args.dtype), kind)
                    first[compiled] = seconds(runs[compiled])
            except Exception as error:  # the compiler's failure is the result
                rows.append({"model": arch, "job": kind, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            times = interleaved(runs, args.rounds, warmup=0)
            rows.append({"model": arch, "job": kind, "eager_ms": ms(times[False]), "compiled_ms": ms(times[True]),
                         "compiled_over_eager": ratio(times[True], times[False]), "first_call_eager_s": first[False],
                         "first_call_compiled_s": first[True], "graphs": counters["stats"]["unique_graphs"],
                         "graph_breaks": sum(counters["graph_break"].values())})  # graphs: so far for this model
            print(json.dumps(rows[-1]), flush=True)
    cells = [[r["model"], r["job"], "", "", f"compiled fails: {r['error']}", "", "", "", ""] if "error" in r else
             [r["model"], r["job"], f"{r['eager_ms']:.0f}", f"{r['compiled_ms']:.0f}", f"{r['compiled_over_eager']:.2f}x",
              f"{r['first_call_eager_s']:.1f}", f"{r['first_call_compiled_s']:.1f}", r["graphs"], r["graph_breaks"]]
             for r in rows]
    lines = [f"# torch.compile of the routed attention modules (CPU, {args.dtype})", ""] + table(
        ["model", "job", "eager ms", "compiled ms", "compiled / eager", "first call eager s", "first call compiled s",
         "graphs", "graph breaks"], cells)
    run = provenance("speed.compile", argv)
    write_result(out, {"run": run, "rows": rows}, "\n".join(lines) + "\n\n" + provenance_line(run))


if __name__ == "__main__":
    main()
