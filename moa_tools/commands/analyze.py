"""``moa-analyze``: what the routers of trained MoA / MoH checkpoints learned, in figures and pictures.

    moa-analyze CHECKPOINT [CHECKPOINT ...] DATA-BIN --subset test --out DIR

Runs each checkpoint teacher-forced over the subset (translation or masked LM; progress on stderr)
and writes into DIR:

* ``routing.json``: per routed module, the expert (MoH: routed-head) load, mean router entropy,
  mean gate weight of the top choice, share of tokens whose top choice changes from the previous
  layer; for MoH the active-head fraction and mean alpha1 / alpha2; per attention module of every
  checkpoint, the head (MoA: expert) similarity;
* ``specialisation.md``: for each expert of one module (``--attention-type``, ``--layer``), the
  tokens with the highest PMI with being routed to it, as in the MoA paper's table;
* ``load_heatmap.png``, ``router_entropy.png``, ``head_similarity.png``: the checkpoints side by side.

A plain Transformer checkpoint is measured for head similarity only; the report says which
measures do not apply. Definitions: :mod:`moa_tools.routing_analysis`. Nothing is written until
every checkpoint has been measured.
"""

import argparse
import json
import os
import sys

from moa_tools import ToolError, require_subset, run_tool
from moa_tools.textio import atomic_text_outputs

ATTENTION_TYPES = ("encoder-self", "decoder-self", "decoder-cross")


def _check_inputs(checkpoints, data_bin, subset, out):
    from moa_tools.checkpoints import load_checkpoint

    require_subset(data_bin, subset, "--subset")
    for path in checkpoints:
        if not os.path.isfile(path):
            raise ToolError(f"no such checkpoint: {path}")
        load_checkpoint(path)  # the safe loader: names a truncated or unsafe file before any work
    if os.path.exists(out) and not os.path.isdir(out):
        raise ToolError(f"--out {out} exists and is not a folder")


def report_of(result: dict, label: str) -> dict:
    from moa_tools.routing_analysis import top_choice_changes

    changes = top_choice_changes(result["modules"])
    modules = [dict(m.summary(), top_choice_change=changes.get(m.name)) for m in result["modules"]]
    not_applicable = [] if modules else [
        f"load, router entropy, top gate weight, top-choice changes and specialisation: a {result['arch']} "
        "checkpoint has no routers; only head similarity applies"]
    return {"label": label, "checkpoint": result["checkpoint"], "arch": result["arch"], "family": result["family"],
            "not_applicable": not_applicable, "modules": modules,
            "similarity": [s.summary() for s in result["similarity"]]}


def specialisation_markdown(results, labels, kind, layer, min_count, top) -> str:
    lines = [f"# Expert specialisation ({kind} attention)", "",
             f"For each expert, the {top} tokens with the highest PMI with being routed to it, "
             "PMI = log p(expert | token) / p(expert) over the (token, slot) assignments of the subset, "
             f"tokens seen fewer than {min_count} times skipped. In brackets: PMI, assignments to the "
             "expert / occurrences of the token."]
    for result, label in zip(results, labels):
        candidates = [m for m in result["modules"] if m.kind == kind]
        lines += ["", f"## {label}" + ("" if result["arch"] in label else f" ({result['arch']})"), ""]
        if not candidates:
            lines.append(f"No routed {kind} module: specialisation does not apply." if not result["modules"] else
                         f"No routed {kind} module; routed types: "
                         f"{', '.join(sorted({m.kind for m in result['modules']}))}.")
            continue
        chosen = [m for m in candidates if m.layer == layer] if layer is not None else candidates[-1:]
        if not chosen:
            lines.append(f"No {kind} module in layer {layer}; layers: {', '.join(str(m.layer) for m in candidates)}.")
            continue
        module = chosen[0]
        dictionary = result["dictionaries"][kind.split("-")[0]]
        load = module.summary()["load"]
        lines += [f"Layer {module.layer}, {module.num_experts} {'experts' if module.family == 'MoA' else 'routed heads'}, "
                  f"top-{module.top_k}, {module.tokens:,} tokens.", "",
                  f"| {'expert' if module.family == 'MoA' else 'routed head'} | load | tokens |", "|---|---|---|"]
        for expert, rows in module.specialisation(min_count, top).items():
            cells = ", ".join(f"`{dictionary[t]}` ({pmi:.2f}, {n}/{occ})" for t, pmi, n, occ in rows) or "—"
            lines.append(f"| {expert} | {load[expert]:.3f} | {cells} |")
    return "\n".join(lines) + "\n"


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-analyze", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="CHECKPOINT ... DATA-BIN",
                        help="one or more checkpoints, then the data-bin folder they were trained on")
    parser.add_argument("--subset", default="test", help="the data-bin subset to run over (default test)")
    parser.add_argument("--out", required=True, help="folder for the report and the figures")
    parser.add_argument("--labels", nargs="+", help="a name per checkpoint (default: its arch and file name)")
    parser.add_argument("--attention-type", choices=ATTENTION_TYPES, default="encoder-self",
                        help="the module type of the specialisation table (default encoder-self)")
    parser.add_argument("--layer", type=int, help="its layer (default: the last)")
    parser.add_argument("--min-count", type=int, default=5, help="skip tokens seen fewer times (default 5)")
    parser.add_argument("--top-tokens", type=int, default=8, help="tokens per expert (default 8)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch (default 4096)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        parser.error("give at least one CHECKPOINT and the DATA-BIN")
    checkpoints, data_bin = args.paths[:-1], args.paths[-1]
    if args.labels and len(args.labels) != len(checkpoints):
        raise ToolError(f"--labels names {len(args.labels)} checkpoints, {len(checkpoints)} were given")
    _check_inputs(checkpoints, data_bin, args.subset, args.out)

    from moa_tools import routing_plots
    from moa_tools.routing_analysis import analyze

    results = []
    for i, path in enumerate(checkpoints):
        results.append(analyze(path, data_bin, args.subset, args.max_tokens,
                               label=args.labels[i] if args.labels else "", progress=not args.no_progress))
    labels = args.labels or [f"{r['arch']} {os.path.basename(r['checkpoint'])}" for r in results]
    if len(set(labels)) < len(labels):
        labels = [f"{i + 1}: {label}" for i, label in enumerate(labels)]
    reports = [report_of(result, label) for result, label in zip(results, labels)]
    for report in reports:
        for line in report["not_applicable"]:
            print(f"{report['label']}: does not apply: {line}", file=sys.stderr)

    os.makedirs(args.out, exist_ok=True)
    written = []

    def out(name):
        written.append(os.path.join(args.out, name))
        return written[-1]

    with atomic_text_outputs(out("routing.json"), out("specialisation.md")) as (report_file, table_file):
        json.dump({"subset": args.subset, "data_bin": data_bin, "checkpoints": reports}, report_file, indent=1)
        table_file.write(specialisation_markdown(results, labels, args.attention_type, args.layer, args.min_count,
                                                 args.top_tokens))
    figures = [("head_similarity.png", routing_plots.similarity_by_layer)]
    if any(r["modules"] for r in reports):
        figures += [("load_heatmap.png", routing_plots.load_heatmap), ("router_entropy.png", routing_plots.entropy_by_layer)]
    for name, draw in figures:
        path = out(name)
        draw(reports, path + ".tmp.png")
        os.replace(path + ".tmp.png", path)
    print("wrote " + ", ".join(written))
    return 0


def main(argv=None) -> int:
    return run_tool("moa-analyze", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
