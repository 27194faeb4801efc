"""The speed guard: the main jobs' speed against the same-shape Transformer, checked against README.

    .venv/bin/python -m benchmarks.guard            # about a minute on 2 idle cores; exit 1 on a regression
    .venv/bin/python -m benchmarks.guard --threads 1

Three jobs, each timed for the routed models and their Transformer twin side by side, in interleaved
rounds in one process (the first round warms up, and measures the paths :mod:`moa.path_choice` picks):

* ``train``: one training step (criterion forward, backward, Adam step) on 128 x 16 tokens at the
  Multi30k shape (``moa_small``, ``moh_small`` against fairseq's Transformer of the same shape);
* ``decode``: beam-4 decoding of 32 sentences of 16 tokens, every hypothesis forced to 16 tokens;
* ``lm``: one decoding step of 8 sentences after 2,048 cached tokens (``moa_lm_small``, ``moh_lm_small``
  at 50% of the heads against ``transformer_lm_small``).

A ratio is the median over rounds of the model's time over the reference's in the same round, the
reference timed twice per round (first and last) and averaged. The machine's noise is measured in the
same run: the ratio of the reference's two timings (an A/A comparison, 1 in expectation) spreads by
the noise of one round; the median of n such ratios has a standard error of about
1.2533 * 1.4826 * MAD / sqrt(n). The job's noise is the larger of twice the A/A median's standard
error and its distance from 1 (a drift between the first and the last timing of a round). A ratio fails
when it exceeds README's figure by more than the largest of: twice the standard error of its own
per-round ratios, the job's noise, and 2%. The guard prints each ratio beside README's figure and exits
1 on a failure (2 when README has no figure for a ratio). On a shared or virtual machine the noise
can change between runs by more than within one: a failure that a rerun does not repeat is the machine.
"""

import argparse
import math
import os
import re
import statistics
import sys
import time

STARTED = time.perf_counter()  # before torch's import, which the minute includes

import torch  # noqa: E402

from benchmarks.common import ROOT

JOBS = {"train": ["moa_small", "moh_small"], "decode": ["moa_small", "moh_small"], "lm": ["moa", "moh-50"]}
REFERENCES = ("transformer", "transformer again")  # two copies of the twin, for the A/A comparison
README_MODELS = {"moa": "moa_lm_small", "moh-50": "moh_lm_small 50%"}  # the LM models' names in the report
README_ROWS = {"train": "training step", "decode": "beam-4 decoding", "lm": "LM decoding step after 2,048 tokens"}
MIN_MARGIN = 0.02


def translation_jobs(names):
    """name -> (train step, beam decode) at the Multi30k shape (benchmarks.moa_speed's ``small`` section)."""
    from benchmarks.moa_speed import SHAPES, beam_decode, shape_model, synthetic_batch, train_step

    _, _, _, bsz, length, sentences = SHAPES["small"]
    jobs = {}
    for name in names:
        model = shape_model("small", name.replace(" again", ""), torch.device("cpu"))
        sample = synthetic_batch(model, bsz, length, length, torch.device("cpu"))
        jobs[name] = (train_step(model, name, sample), beam_decode(model, sample, sentences, length))
    return jobs


def lm_jobs(names, context=2048, bsz=8, steps=4):
    """name -> ``steps`` decoding steps after ``context`` cached tokens (benchmarks.lm_decoding's models)."""
    from benchmarks.lm_decoding import MODELS, build_lm, filled_state

    jobs = {}
    for name in names:
        model = build_lm(*MODELS[name.replace(" again", "")][1:], max_positions=context + 16)
        state = filled_state(model, bsz, context)
        tokens = torch.randint(4, 100, (bsz, context + 1))

        def step(model=model, state=state, tokens=tokens):
            with torch.no_grad():
                for _ in range(steps):  # from the same cache each time
                    model(tokens, incremental_state={key: dict(value) for key, value in state.items()})
        jobs[name] = step
    return jobs


def interleaved(jobs, rounds):
    """Per-round seconds of every job, run in turn (so that none runs twice in a row); round 0 warms up."""
    times = {name: [] for name in jobs}
    for round_ in range(rounds + 1):
        for name, run in jobs.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


def ratios(times, names):
    """name -> per-round ratios to the mean of the two references' times; and the references' A/A ratios."""
    base = [(a + b) / 2 for a, b in zip(times[REFERENCES[0]], times[REFERENCES[1]])]
    per_round = {name: [t / b for t, b in zip(times[name], base)] for name in names}
    return per_round, [b / a for a, b in zip(*(times[r] for r in REFERENCES))]


def median_error(values):
    """Standard error of the median of ``values`` from their median absolute deviation."""
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def readme_figures(path=os.path.join(ROOT, "README.md")):
    """(job, column) -> the ratio README's guard table quotes; its columns are MoA and MoH, in the
    order of each job's routed models."""
    figures = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    header = re.search(r"^\| speed, as `python -m benchmarks.guard` measures it \|", text, re.M)
    if not header:
        return figures
    for job, label in README_ROWS.items():
        row = re.search(rf"^\| {re.escape(label)}[^|]*\|(.*)\|$", text[header.end():], re.M)
        if not row:
            continue
        for column, cell in enumerate(row.group(1).split("|")):
            number = re.search(r"(\d+\.\d+)x", cell)
            if number:
                figures[(job, column)] = float(number.group(1))
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, nargs=3, default=[4, 8, 8], metavar=("TRAIN", "DECODE", "LM"),
                        help="timed rounds of each job (after one warm-up round)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS), help="a subset of the jobs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    order = [REFERENCES[0], "moa_small", REFERENCES[1], "moh_small"]  # no model runs twice in a row
    translation = translation_jobs(order) if {"train", "decode"} & set(args.jobs) else {}
    job_runs = {"train": {name: jobs[0] for name, jobs in translation.items()},
                "decode": {name: jobs[1] for name, jobs in translation.items()},
                "lm": lm_jobs([REFERENCES[0], "moa", REFERENCES[1], "moh-50"]) if "lm" in args.jobs else {}}
    quoted = readme_figures()
    failed = missing = False
    print(f"{'job':8s} {'model':18s} {'ratio':>7s} {'README':>7s} {'margin':>7s}  verdict")
    for (job, names), rounds in zip(JOBS.items(), args.rounds):
        if job not in args.jobs:
            continue
        job_started = time.perf_counter()
        per_round, same = ratios(interleaved(job_runs[job], rounds), names)
        noise = max(2 * median_error(same), abs(statistics.median(same) - 1))
        print(f"{job:8s} {'A/A (noise)':18s} {statistics.median(same):7.3f} {'':>7s} {noise:7.3f}  "
              f"{rounds} rounds, {time.perf_counter() - job_started:.0f} s")
        for column, name in enumerate(names):
            ratio = statistics.median(per_round[name])
            margin = max(MIN_MARGIN, 2 * median_error(per_round[name]), noise)
            model = README_MODELS.get(name, name)
            figure = quoted.get((job, column))
            if figure is None:
                verdict, missing = "no README figure", True
            elif ratio > figure + margin:
                verdict, failed = f"SLOWER than README by {ratio - figure:.3f}", True
            else:
                verdict = "ok"
            print(f"{job:8s} {model:18s} {ratio:7.3f} {figure or float('nan'):7.2f} {margin:7.3f}  {verdict}",
                  flush=True)
    print(f"{time.perf_counter() - STARTED:.0f} s in all, {torch.get_num_threads()} threads")
    return 1 if failed else 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
