"""An exported translation model against fairseq-generate, side by side: the same hypotheses, and the time each takes.

    .venv/bin/python -m benchmarks.hf_export --name NAME --checkpoint CKPT --data-bin DATA_BIN \\
        --raw-source FILE [--sentencepiece-model SPM] [--post-process none|sentencepiece] [--out OUT]

fairseq-generate translates the data-bin's test subset (beam 4, length penalty 0.6, batches of 128 sentences,
``--required-batch-size-multiple 1``); ``moa-export-hf`` writes the model; in a process where fairseq and moa
cannot be imported, transformers loads it and its tokenizer, encodes ``--raw-source`` (the test subset's source
lines as a user has them) and ``generate()`` (the exported settings) translates them in fairseq's batches and
order. Reported: the sentences whose tokenizer ids are the data-bin's, whose hypothesis is fairseq's token for
token, and whose decoded text is fairseq's (``--post-process``); the seconds each spent translating
(fairseq-generate's own "Translated ... in S s", generate()'s loop; medians of --rounds, the sides
alternating) and their ratio. What it found:
benchmarks/hf_export/README.md.
"""

import json
import os
import re
import statistics
import subprocess
import tempfile

from benchmarks.harness.isolation import run_without_fairseq
from benchmarks.harness.results import provenance, provenance_line, study_parser, study_results, table, write_result
from moa_tools import USER_DIR, fairseq_command, run_logged
from moa_tools.textio import read_lines

BATCH = 128
HF_SIDE = r'''
import json, time
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

folder, inputs, out = sys.argv[1:4]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
job = json.load(open(inputs))
ids = {i: tokenizer(line).input_ids for i, line in job["raw"].items()}
pad, eos = model.config.pad_token_id, model.config.eos_token_id
hypotheses, started = {}, time.perf_counter()
for batch in job["batches"]:
    rows = [ids[str(i)] for i in batch]
    source = torch.full((len(rows), max(map(len, rows))), pad)
    for r, row in enumerate(rows):
        source[r, : len(row)] = torch.tensor(row)
    for i, row in zip(batch, model.generate(source).tolist()):
        hypotheses[i] = row[1: row.index(eos, 1)]
seconds = time.perf_counter() - started
json.dump({"ids": ids, "hypotheses": hypotheses, "seconds": seconds, "torch_threads": torch.get_num_threads(),
           "texts": {i: tokenizer.decode(h) for i, h in hypotheses.items()}}, open(out, "w"))
'''


def fairseq_side(checkpoint, data_bin, log):
    """fairseq-generate on the test subset: ({sentence id: hypothesis symbols}, [batches of ids in the order
    translated], fairseq's own seconds)."""
    output = run_logged([fairseq_command("fairseq-generate"), data_bin, "--user-dir", USER_DIR, "--cpu",
                         "--gen-subset", "test", "--path", checkpoint, "--beam", "4", "--lenpen", "0.6",
                         "--batch-size", str(BATCH), "--required-batch-size-multiple", "1", "--num-workers", "0"], log)
    with open(log, encoding="utf-8") as f:
        hypotheses = {int(i): line.split() for i, line in re.findall(r"^H-(\d+)\t[^\t]*\t(.*)$", f.read(), re.M)}
        f.seek(0)
        order = [int(i) for i in re.findall(r"^S-(\d+)\t", f.read(), re.M)]
    seconds = float(re.search(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in ([\d.]+)s", output).group(1))
    return hypotheses, [order[i: i + BATCH] for i in range(0, len(order), BATCH)], seconds


def source_ids(data_bin, checkpoint):
    """The data-bin's test source ids by sentence, as fairseq read them for the model of ``checkpoint``."""
    from fairseq.data import Dictionary, data_utils

    from moa_tools.checkpoints import load_checkpoint
    from moa_tools.hf_export import translation_languages

    src, tgt = translation_languages(data_bin, load_checkpoint(checkpoint))
    dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{src}.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(data_bin, f"test.{src}-{tgt}.{src}"), dictionary)
    return [dataset[i].tolist() for i in range(len(dataset))], dictionary


def main(argv=None):
    parser = study_parser("hf_export", __doc__)
    parser.add_argument("--name", required=True, help="the model's name in the result")
    parser.add_argument("--out", help="where the result goes, OUT.{json,md} (default: results/NAME)")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-bin", required=True)
    parser.add_argument("--raw-source", required=True, help="the test subset's source lines, one per sentence")
    parser.add_argument("--rounds", type=int, default=5, help="times each side translates (medians reported)")
    parser.add_argument("--sentencepiece-model", help="the data's sentencepiece model (moa-export-hf's flag)")
    parser.add_argument("--post-process", choices=["none", "sentencepiece"], default="none",
                        help="fairseq's post-processing of its hypotheses, compared with the tokenizer's decode "
                             "(none: the dictionary's symbols, which the exported word tokenizer decodes to)")
    args = parser.parse_args(argv)
    from fairseq.data.data_utils import post_process

    run = provenance("hf_export", argv)
    reference_ids, dictionary = source_ids(args.data_bin, args.checkpoint)
    raw = list(read_lines(args.raw_source))
    assert len(raw) == len(reference_ids), f"{args.raw_source}: {len(raw)} lines, the test subset {len(reference_ids)}"
    with tempfile.TemporaryDirectory() as work:
        export = [fairseq_command("moa-export-hf"), args.checkpoint, args.data_bin, os.path.join(work, "hf")]
        subprocess.run(export + (["--sentencepiece-model", args.sentencepiece_model] if args.sentencepiece_model
                                 else []), check=True, capture_output=True)
        fairseq_runs, hf_runs = [], []
        for _ in range(args.rounds):  # the two sides alternate, one at a time
            fairseq_runs.append(fairseq_side(args.checkpoint, args.data_bin, os.path.join(work, "generate.log")))
            with open(os.path.join(work, "job.json"), "w") as f:
                json.dump({"raw": dict(enumerate(raw)), "batches": fairseq_runs[0][1]}, f)
            hf_side = run_without_fairseq(HF_SIDE, os.path.join(work, "hf"), os.path.join(work, "job.json"),
                                          os.path.join(work, "out.json"), cwd=work)
            if hf_side.returncode:
                raise SystemExit(f"the transformers side failed:\n{hf_side.stderr[-3000:]}")
            with open(os.path.join(work, "out.json")) as f:
                hf_runs.append(json.load(f))
    fairseq_hypotheses = fairseq_runs[0][0]
    hf = hf_runs[0]
    if any(r[0] != fairseq_hypotheses for r in fairseq_runs) or any(r["hypotheses"] != hf["hypotheses"] for r in hf_runs):
        raise SystemExit("a side's hypotheses changed between rounds")
    fairseq_seconds = statistics.median(r[2] for r in fairseq_runs)
    hf_seconds = statistics.median(r["seconds"] for r in hf_runs)
    n = len(reference_ids)
    same_ids = sum(hf["ids"][str(i)] == reference_ids[i] for i in range(n))
    same_tokens = sum(hf["hypotheses"][str(i)] == [dictionary.index(s) for s in fairseq_hypotheses[i]] for i in range(n))
    same_text = sum(hf["texts"][str(i)] == post_process(" ".join(fairseq_hypotheses[i]), args.post_process)
                    for i in range(n))
    report = {"run": run, "name": args.name, "sentences": n, "tokenizer_ids_equal": same_ids,
              "hypotheses_equal": same_tokens, "texts_equal": same_text, "fairseq_seconds": fairseq_seconds,
              "generate_seconds": hf_seconds, "rounds": args.rounds,
              "fairseq_seconds_by_round": [r[2] for r in fairseq_runs],
              "generate_seconds_by_round": [r["seconds"] for r in hf_runs], "generate_torch_threads": hf["torch_threads"],
              "checkpoint": args.checkpoint, "post_process": args.post_process}
    rows = [[args.name, n, f"{same_ids} ({same_ids / n:.1%})", f"{same_tokens} ({same_tokens / n:.1%})",
             f"{same_text} ({same_text / n:.1%})", f"{fairseq_seconds:.2f}", f"{hf_seconds:.2f}",
             f"{hf_seconds / fairseq_seconds:.2f}x"]]
    text = "\n".join([f"# {args.name}: the exported model against fairseq-generate", "",
                      *table(["model", "test sentences", "tokenizer ids = data-bin's", "hypotheses = fairseq's (ids)",
                              f"decoded text = fairseq's ({args.post_process})", "fairseq-generate s (median)",
                              "transformers generate() s (median)", "time ratio"], rows), "",
                      f"Checkpoint: `{args.checkpoint}`. Beam 4, length penalty 0.6, batches of {BATCH} sentences in "
                      f"fairseq's order; {args.rounds} rounds, the two sides alternating, one at a time on the same "
                      f"machine, {hf['torch_threads']} threads (seconds by round: fairseq-generate "
                      f"{', '.join(f'{r[2]:.2f}' for r in fairseq_runs)}; generate() "
                      f"{', '.join(f'{seconds:.2f}' for seconds in report['generate_seconds_by_round'])}).", "",
                      provenance_line(run), ""])
    write_result(args.out or study_results("hf_export", args.name), report, text)
    print(text)


if __name__ == "__main__":
    main()
