"""The inference-time compute dial: quality and decoding speed of trained MoA and MoH models at every
number of active experts or routed heads, side by side with the Transformer trained beside them.

    .venv/bin/python -m benchmarks.compute_dial --workdir benchmarks/work-multi30k [--pair en-de] [--seed 1]

Reads the checkpoints a ``benchmarks.multi30k.equal_time`` run left in WORKDIR (``moa``, ``moh`` and
``transformer`` of one pair and seed); what is measured: benchmarks/compute_dial/README.md.
"""

import json
import os
import statistics

import torch

from benchmarks.harness.fairseq_runs import translate_and_score
from benchmarks.harness.macs import macs_per_target_token
from benchmarks.harness.results import provenance, provenance_line, study_parser, study_results, table, write_result
from benchmarks.harness.timing import interleaved, ratio
from moa_tools.textio import read_lines

DIALS = {"moa": "moa_top_k", "moh": "moh_top_k"}


def settings(checkpoint, model_id):
    """[(k, overrides, trained, description)] of a checkpoint: every k of MoA (1..E), every routed K of
    MoH (0..E)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    args = state["args"] if state.get("args") is not None else state["cfg"]["model"]
    if model_id == "moa":
        trained, experts = args.moa_top_k, args.moa_experts
        values, describe = range(1, experts + 1), (lambda k: f"k = {k} of {experts} experts")
    else:
        shared, trained = args.moh_shared_heads, args.moh_top_k
        experts = args.encoder_attention_heads - shared
        values, describe = range(0, experts + 1), (lambda k: f"{shared} shared + top-{k} of {experts} routed heads")
    return [(k, {DIALS[model_id]: k}, k == trained, describe(k)) for k in values]


def load(checkpoint, data_bin, overrides):
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": data_bin, **overrides})
    return models[0].eval(), task


def decode_timer(model, task, sources, batch_size=128):
    """Beam-4 decoding (length penalty 0.6) of the encoded ``sources``, in batches."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, len_penalty=0.6)
    pad = task.source_dictionary.pad()
    batches = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start:start + batch_size]
        width = max(len(s) for s in chunk)
        tokens = torch.full((len(chunk), width), pad, dtype=torch.long)
        for i, s in enumerate(chunk):
            tokens[i, width - len(s):] = s  # left padding, as fairseq batches sources
        batches.append({"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([len(s) for s in chunk])}})

    def decode():
        with torch.no_grad():
            for batch in batches:
                generator.generate([model], batch)

    return decode


def main(argv=None):
    parser = study_parser("compute_dial", __doc__)
    parser.add_argument("--workdir", required=True, help="the --workdir of a benchmarks.multi30k.equal_time run")
    parser.add_argument("--pair", default="en-de", choices=["en-de", "en-fr"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=128, help="test sentences in the speed measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="k = 1 and the trained setting only, 16 sentences, 1 round, MACs on 20 pairs")
    parser.add_argument("--out", default=study_results("compute_dial", "compute-dial"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.sentences, args.rounds = 16, 1
    src, tgt = args.pair.split("-")
    data_dir = os.path.join(args.workdir, f"multi30k-{args.pair}")
    data_bin = os.path.join(data_dir, "data-bin")
    checkpoints = {m: os.path.join(args.workdir, args.pair, f"seed{args.seed}", m, "checkpoint_best.pt")
                   for m in ("transformer", "moa", "moh")}
    missing = [path for path in checkpoints.values() if not os.path.exists(path)]
    if missing:
        raise SystemExit(f"no checkpoint {missing[0]}: run benchmarks.multi30k.equal_time --pairs {args.pair} "
                         f"--models transformer moa moh --workdir {args.workdir} first")
    run = provenance("compute_dial", argv)
    rows = [{"model_id": "transformer", "setting": None, "trained_setting": True, "overrides": {},
             "active": "every head"}]
    for model_id in DIALS:
        rows += [{"model_id": model_id, "setting": k, "trained_setting": trained, "overrides": overrides,
                  "active": active + (" (trained)" if trained else "")}
                 for k, overrides, trained, active in settings(checkpoints[model_id], model_id)
                 if not args.smoke or trained or k == 1]

    for row in rows:  # quality, through the real CLI
        checkpoint = checkpoints[row["model_id"]]
        extra = ["--model-overrides", repr(row["overrides"])] if row["overrides"] else []
        name = f"generate-{row['model_id']}" + ("" if row["setting"] is None else f"-k{row['setting']}") + ".log"
        row.update(translate_and_score(checkpoint, data_dir, tgt, os.path.join(os.path.dirname(checkpoint), name),
                                       extra))
        row["macs_per_target_token"] = macs_per_target_token(data_dir, src, tgt, checkpoint, overrides=row["overrides"],
                                                             pairs=20 if args.smoke else 200)
        print(json.dumps({k: row[k] for k in ("model_id", "setting", "sacrebleu", "macs_per_target_token")}),
              flush=True)

    # speed, side by side in one process
    task_dictionary = None
    jobs = []
    lines = list(read_lines(os.path.join(data_dir, "spm", f"test_2016_flickr.{src}")))[:args.sentences]
    for row in rows:
        model, task = load(checkpoints[row["model_id"]], data_bin, row["overrides"])
        task_dictionary = task_dictionary or task.source_dictionary
        sources = [task_dictionary.encode_line(line, add_if_not_exist=False).long() for line in lines]
        jobs.append(decode_timer(model, task, sources))
    times = list(interleaved(dict(enumerate(jobs)), args.rounds).values())
    for row, own in zip(rows, times):
        row["decode_sentences_per_s"] = len(lines) / statistics.median(own)
        row["decode_time_ratio"] = ratio(own, times[0])
        row["speed_sentences"], row["speed_rounds"] = len(lines), args.rounds
    report = {"pair": args.pair, "seed": args.seed, "rows": rows, "run": run}
    write_result(args.out, report, markdown(report))


def markdown(report):
    rows = report["rows"]
    transformer = rows[0]
    lines = [f"Multi30k {report['pair']}, seed {report['seed']}: each trained model decoded at every number of active "
             "experts (MoA's k) or routed heads (MoH's K), nothing else changed. sacreBLEU: every test_2016_flickr "
             "sentence through fairseq-generate (beam 4, length penalty 0.6). MACs: the method's forward MACs per "
             "target token (routed experts only), teacher-forced. Speed: beam-4 decoding of the first "
             f"{transformer['speed_sentences']} test sentences, medians of {transformer['speed_rounds']} interleaved "
             "rounds; time ratio to the Transformer per round (below 1: faster).", "",
             ]
    labels = {"transformer": "Transformer", "moa": "MoA (moa_small)", "moh": "MoH (moh_small)"}
    lines += table(["model", "active", "sacreBLEU", "MACs/token", "MACs ratio", "sentences/s", "time ratio"],
                   [[labels[r["model_id"]], r["active"], f"{r['sacrebleu']:.2f}", f"{r['macs_per_target_token'] / 1e6:.2f}M",
                     f"{r['macs_per_target_token'] / transformer['macs_per_target_token']:.2f}",
                     f"{r['decode_sentences_per_s']:.1f}", f"{r['decode_time_ratio']:.2f}"] for r in rows])
    lines += ["", f"- {provenance_line(report['run'])}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
