"""The speed guard: this working tree against a base commit, side by side in one run.

    .venv/bin/python -m benchmarks.dev.guard                     # against main's last commit; 2 to 2.5 minutes
    .venv/bin/python -m benchmarks.dev.guard --base HEAD --inject-slowdown train-moa=0.1   # must fail

Each side's ``moa`` runs in a worker process of its own (this file, that side's ``moa`` first on the path),
which forks a fresh process per measurement; the parent runs one process at a time. A job's ratio is the
median of its rounds' new / base CPU times over 4 process pairs, its noise twice that median's standard
error (at least 2%); it fails (exit 1) beyond 1 + noise. Jobs and why so: benchmarks/dev/README.md.
"""

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = ("train-moa", "train-moh", "decode-moa", "decode-moh", "lm-moa", "lm-moh")
ROUNDS = {"train": 10, "decode": 6, "lm": 8}  # timed rounds per process pair, by job kind
MIN_NOISE = 0.02
VOCABULARY, LENGTH, SENTENCES, TRAIN_BATCH = 8000, 16, 16, 16
LM_CONTEXT, LM_BATCH, LM_STEPS = 2048, 8, 4
MODELS = {"moa": ("moa_small", "moa_lm_small", []),
          "moh": ("moh_small", "moh_lm_small", ["--moh-shared-heads", "1", "--moh-top-k", "1"])}


# ---- the worker: one side's models and jobs -------------------------------------------------------

def worker(tree, threads):
    """One side: import torch, fairseq and the ``moa`` of ``tree`` once, then for each ``job NAME`` line
    of stdin fork a process that builds that job's model (so that every job starts from the same fresh
    heap on both sides, whatever ran before it) and answers each ``run`` line with ``GUARD <cpu seconds>
    <wall seconds>`` of one run, until ``end`` (answered ``GUARD done``)."""
    sys.path.insert(0, tree)
    import torch
    import fairseq.options  # noqa: F401
    import moa  # noqa: F401  (this side's, registered before fairseq reads --user-dir)

    if not os.path.abspath(moa.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"guard worker: imported moa from {moa.__file__}, not from {tree}")
    if threads:
        torch.set_num_threads(threads)
    folder = tempfile.mkdtemp(prefix="moa-guard-")
    answer("ready")
    while True:
        line = sys.stdin.readline().split()
        if not line:
            return
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            continue
        run = build_job(line[1], os.path.join(tree, "moa"), folder)
        answer("ready")
        while sys.stdin.readline().strip() == "run":
            cpu, wall = time.process_time(), time.perf_counter()
            run()
            answer(f"{time.process_time() - cpu:.6f} {time.perf_counter() - wall:.6f}")
        answer("done")  # before the next line is sent, which this process's buffered stdin must not read
        os._exit(0)


def answer(text):
    sys.stdout.write(f"GUARD {text}\n")
    sys.stdout.flush()


def build_job(job, user_dir, folder):
    """A call that runs ``job`` once, its model built through fairseq's parser from seed 0."""
    import torch
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    kind, family = job.split("-")
    translation, lm, flags = MODELS[family]
    dictionary = Dictionary()
    for i in range(VOCABULARY - 4):
        dictionary.add_symbol(f"w{i}")
    for name in ("dict.en.txt", "dict.de.txt", "dict.txt"):
        dictionary.save(os.path.join(folder, name))
    common = [folder, "--user-dir", user_dir, "--dropout", "0.1"] + flags
    if kind == "lm":
        argv = common + ["--task", "language_modeling", "--arch", lm, "--tokens-per-sample", str(LM_CONTEXT + 64),
                         "--max-target-positions", str(LM_CONTEXT + 64), "--criterion", "moa_cross_entropy"]
    else:
        argv = common + ["--arch", translation, "--share-all-embeddings", "-s", "en", "-t", "de",
                         "--criterion", "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    model = task.build_model(args)
    generator = torch.Generator().manual_seed(1)
    if kind == "lm":
        return lm_steps(model.eval(), generator)
    bsz = TRAIN_BATCH if kind == "train" else SENTENCES
    src, tgt = (torch.randint(4, VOCABULARY, (bsz, LENGTH), generator=generator) for _ in range(2))
    if kind == "train":
        prev = torch.cat([torch.full((bsz, 1), dictionary.eos()), tgt[:, :-1]], 1)
        sample = {"id": torch.arange(bsz), "nsentences": bsz, "ntokens": bsz * LENGTH, "target": tgt,
                  "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), LENGTH), "prev_output_tokens": prev}}
        criterion, optimizer = task.build_criterion(args), torch.optim.Adam(model.parameters(), lr=1e-4)
        model.train()

        def step():
            optimizer.zero_grad()
            criterion(model, sample)[0].backward()
            optimizer.step()
        return step
    gen_args = options.parse_args_and_arch(options.get_generation_parser(), [
        folder, "--user-dir", user_dir, "--beam", "4", "--min-len", str(LENGTH), "--max-len-a", "0",
        "--max-len-b", str(LENGTH), "-s", "en", "-t", "de"])
    beam = task.build_generator([model.eval()], gen_args)
    sample = {"id": torch.arange(bsz), "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), LENGTH)}}

    def decode():
        with torch.no_grad():
            task.inference_step(beam, [model], sample)
    return decode


def lm_steps(model, generator):
    """``LM_STEPS`` decoding steps from one cache of ``LM_CONTEXT`` random keys and values per layer, made
    through the model's own code: one step makes every cache, each is replaced by ``LM_CONTEXT`` random
    positions (its time axis the second to last), and one more step lets the module store them its way."""
    import torch

    tokens = torch.randint(4, VOCABULARY, (LM_BATCH, LM_CONTEXT + LM_STEPS + 2), generator=generator)
    state = {}
    with torch.no_grad():
        model(tokens[:, :1], incremental_state=state)
        for buffer in state.values():
            for name in [key for key in buffer if key not in ("prev_key", "prev_value")]:
                del buffer[name]  # padding masks and a side's own stores: made again from the new caches
            for name in ("prev_key", "prev_value"):
                shape = list(buffer[name].shape)
                shape[-2] = LM_CONTEXT
                buffer[name] = torch.randn(shape, generator=generator)
        model(tokens[:, :LM_CONTEXT + 1], incremental_state=state)

    def steps():
        with torch.no_grad():
            for i in range(LM_STEPS):  # from the same cache each time
                model(tokens[:, :LM_CONTEXT + 2 + i], incremental_state={key: dict(value) for key, value in state.items()})
    return steps


# ---- the parent: two workers, interleaved rounds, the verdict --------------------------------------

class Side:
    """A worker process for one side; :meth:`run` times one run of a job."""

    def __init__(self, name, tree, threads, slowdown=None):
        self.name, self.slowdown = name, slowdown or {}
        command = [sys.executable, os.path.abspath(__file__), "--worker", tree]
        if threads:
            command += ["--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        stderr=subprocess.DEVNULL, cwd=tree)

    def answer(self):
        for line in self.process.stdout:
            if line.startswith("GUARD "):
                return line.split()[1:]
        raise RuntimeError(f"the {self.name} worker stopped (run it alone to see why: "
                           f"{sys.executable} {__file__} --worker TREE, then type: job {JOBS[0]}, run)")

    def send(self, line):
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def start(self, job):
        """Build ``job`` in a fresh process."""
        self.job = job
        self.send(f"job {job}")
        self.answer()

    def run(self):
        self.send("run")
        cpu, wall = map(float, self.answer())
        job = self.job
        extra = self.slowdown.get(job, 0.0) * cpu
        if extra:  # the injected regression: burn that much more CPU time
            until = time.process_time() + extra
            while time.process_time() < until:
                pass
        return cpu + extra

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def measure_pair(sides, job, rounds, first):
    """new / base for ``job`` in one fresh process per side: ``rounds`` per-round ratios after a warm-up
    run, the side ``first`` (0 or 1) built and run first, then the order alternating."""
    sides = sides if first == 0 else sides[::-1]
    for side in sides:
        side.start(job)
        side.run()  # warm-up
    ratios = []
    for round_ in range(rounds):
        times = {side.name: side.run() for side in (sides if round_ % 2 == 0 else sides[::-1])}
        ratios.append(times["new"] / times["base"])
    for side in sides:
        side.send("end")
        side.answer()
    return ratios


def median_error(values):
    """Standard error of the median of ``values`` from their median absolute deviation."""
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def verdict(ratios):
    """(ratio, noise, failed) of a job from its per-round ratios (every process pair's): their median,
    twice its standard error (at least ``MIN_NOISE``), and whether the ratio exceeds 1 by more than that."""
    ratio = statistics.median(ratios)
    noise = max(MIN_NOISE, 2 * median_error(ratios))
    return ratio, noise, ratio > 1 + noise


def checkout(ref, folder):
    """REF's ``moa`` package (committed files) into ``folder``; its commit id."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{ref}^{{commit}}"], capture_output=True,
                            text=True)
    if commit.returncode:
        raise SystemExit(f"--base {ref}: not a commit of this repository ({commit.stderr.strip()})")
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", commit.stdout.strip(), "moa"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", folder], stdin=archive.stdout, check=True)
    archive.wait()
    return commit.stdout.strip()


def parse_slowdown(values):
    slowdown = {}
    for value in values or ():
        job, _, fraction = value.partition("=")
        if job not in JOBS:
            raise SystemExit(f"--inject-slowdown {value}: expected JOB=FRACTION with JOB one of {', '.join(JOBS)}")
        slowdown[job] = float(fraction)
    return slowdown


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dev.guard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="the commit to compare with (default: main's last commit)")
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS), help="a subset of the jobs")
    parser.add_argument("--processes", type=int, default=4, help="process pairs per job (default 4)")
    parser.add_argument("--rounds", type=int, help="timed rounds per process pair (default: train 10, decode 6, lm 8)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads in both workers (default: torch's own)")
    parser.add_argument("--inject-slowdown", nargs="+", metavar="JOB=FRACTION",
                        help="make the new side that much slower at JOB (to see the guard fail)")
    parser.add_argument("--worker", metavar="TREE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.threads)
    slowdown = parse_slowdown(args.inject_slowdown)
    with tempfile.TemporaryDirectory(prefix="moa-guard-base-") as base_tree, \
            tempfile.TemporaryDirectory(prefix="moa-guard-new-") as new_tree:
        commit = checkout(args.base, base_tree)
        # the working tree's moa, copied as the base's is, so that the two sides differ in their code alone
        shutil.copytree(os.path.join(ROOT, "moa"), os.path.join(new_tree, "moa"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        sides = [Side("base", base_tree, args.threads), Side("new", new_tree, args.threads, slowdown)]
        try:
            for side in sides:
                side.answer()  # built
            print(f"new: the working tree at {ROOT}; base: {args.base} = {commit[:10]}; "
                  f"started in {time.perf_counter() - STARTED:.0f} s")
            print(f"{'job':11s} {'new/base':>8s} {'noise':>6s}  verdict")
            failed = False
            for job in args.jobs:
                started = time.perf_counter()
                rounds = args.rounds or ROUNDS[job.split("-")[0]]
                pairs = [measure_pair(sides, job, rounds, pair % 2) for pair in range(args.processes)]
                ratio, noise, slower = verdict([r for pair in pairs for r in pair])
                failed |= slower
                print(f"{job:11s} {ratio:8.3f} {noise:6.3f}  {'SLOWER' if slower else 'ok':6s}  "
                      f"{args.processes} x {rounds} rounds, {time.perf_counter() - started:.0f} s; "
                      f"medians per process pair: {' '.join(f'{statistics.median(p):.3f}' for p in pairs)}", flush=True)
        finally:
            for side in sides:
                side.close()
    import torch
    print(f"{time.perf_counter() - STARTED:.0f} s in all, {args.threads or torch.get_num_threads()} threads; "
          f"{'a job is slower than the base beyond its noise' if failed else 'no job slower than the base beyond its noise'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
