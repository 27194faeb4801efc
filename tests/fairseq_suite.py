"""fairseq's own test suite, run without and with the plugin loaded: every test that passes without it
must pass with it (loading ``--user-dir moa`` must not change fairseq).

    .venv/bin/python tests/fairseq_suite.py                 # .ci/run's selection, from the package index
    .venv/bin/python tests/fairseq_suite.py --tests DIR/tests --files test_binaries.py ...   # any selection

The tests come from the ``fairseq-fixed`` source distribution on the package index (the version
installed), which carries fairseq's ``tests/`` except ``tests/utils.py``: the default selection is the
files that do not need it. ``--tests`` takes a checkout's ``tests/`` folder instead (the fork's
repository has ``utils.py``). "With the plugin" imports ``moa`` first in every process, through a
``sitecustomize`` on ``PYTHONPATH``, so that processes the tests spawn load it too. Prints a table
per file (passed / failed / skipped, without and with) and exits 1 when a test that passes without
the plugin does not pass with it; ``--out FILE`` also writes the table, with what made it, to FILE
(benchmarks/dev/results/fairseq-suite.md is the documentation's).
"""

import argparse
import collections
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree

SELF_CONTAINED = ["test_train.py", "test_checkpoint_utils_for_task_level_attributes.py", "test_iterators.py",
                  "test_dictionary.py", "test_data_utils.py", "test_metrics.py", "test_utils.py",
                  "test_average_checkpoints.py", "test_multihead_attention.py", "test_fp16_optimizer.py",
                  "test_memory_efficient_fp16.py", "test_amp_optimizer.py", "test_ema.py", "test_positional_encoding.py",
                  "test_rotary_positional_embedding.py", "test_file_io.py", "test_activation_checkpointing.py",
                  "test_constraints.py", "test_character_token_embedder.py", "test_resampling_dataset.py",
                  "test_sparse_multihead_attention.py", "test_convtbc.py"]  # none imports tests/utils.py


def fetch_tests(work: str) -> str:
    """fairseq's tests/ from the installed version's source distribution on the package index."""
    import fairseq

    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--quiet",
                    "--disable-pip-version-check", "-d", work, f"fairseq-fixed=={fairseq.__version__}"], check=True)
    archive = next(os.path.join(work, name) for name in os.listdir(work) if name.endswith(".tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
        tar.extractall(work, members=members, filter="data")
    return os.path.join(work, members[0].name.split("/")[0], "tests")


def run(tests: str, files, plugin: bool, work: str):
    """{test id: outcome} of one pytest run over ``files``, with or without the plugin loaded."""
    env = dict(os.environ)
    if plugin:
        site = os.path.join(work, "with-moa")
        os.makedirs(site, exist_ok=True)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write("import moa  # the plugin, loaded first in every process\n")
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
    report = os.path.join(work, f"report-{'with' if plugin else 'without'}.xml")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    "--continue-on-collection-errors",
                    f"--junitxml={report}", *[os.path.join("tests", f) for f in files]],
                   cwd=os.path.dirname(tests), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tests/fairseq_suite.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", help="a tests/ folder (default: fetched from the package index)")
    parser.add_argument("--files", nargs="+", default=SELF_CONTAINED, help="test files or folders under tests/")
    parser.add_argument("--out", help="also write the table and what made it to this Markdown file")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="fairseq-suite-")
    tests = os.path.abspath(args.tests) if args.tests else fetch_tests(work)
    without, with_plugin = (run(tests, args.files, plugin, work) for plugin in (False, True))
    by_file = collections.defaultdict(lambda: collections.Counter())
    for test in sorted(set(without) | set(with_plugin)):
        module = test.split("::")[0] or test.split("::")[1]  # a collection error names the module alone
        parts = module.split(".")[1:] if module.startswith("tests.") else module.split(".")
        depth = next((i for i, part in enumerate(parts) if part.startswith("test")), len(parts) - 1)
        name = "/".join(parts[:depth + 1]) + ".py"  # e.g. distributed/test_utils.py
        by_file[name][("without", without.get(test, "missing"))] += 1
        by_file[name][("with", with_plugin.get(test, "missing"))] += 1
    lines = ["| file | without the plugin: passed / failed / skipped | with it: passed / failed / skipped |", "|---|---|---|"]
    totals = collections.Counter()
    for name, counts in sorted(by_file.items()):
        totals.update(counts)
        cells = [" / ".join(str(counts[(side, o)]) for o in ("passed", "failed", "skipped")) for side in ("without", "with")]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    cells = [" / ".join(str(totals[(side, o)]) for o in ("passed", "failed", "skipped")) for side in ("without", "with")]
    lines.append(f"| all | {cells[0]} | {cells[1]} |")
    broken = [t for t, outcome in without.items() if outcome == "passed" and with_plugin.get(t) != "passed"]
    mended = [t for t, outcome in without.items() if outcome == "failed" and with_plugin.get(t) == "passed"]
    lines.append(f"\n{len(mended)} of fairseq's failures pass with the plugin; {len(broken)} passing tests fail with it")
    lines += [f"  broken by the plugin: {test}" for test in broken]
    print("\n".join(lines))
    if args.out and without:
        write_record(args.out, lines, argv)
    if not without:
        print("no test ran", file=sys.stderr)
        return 1
    return 1 if broken else 0


def write_record(out: str, lines, argv) -> None:
    """The table in ``out``, headed by the selection and closed by what made it (command, commit, versions)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.harness.results import provenance, provenance_line, write_atomically

    run = provenance("dev", sys.argv[1:] if argv is None else argv)
    run["command"] = run["command"].replace("python -m benchmarks.dev", ".venv/bin/python tests/fairseq_suite.py", 1)
    head = "fairseq's own tests (fairseq-fixed), each file run without and with `import moa` done first in every process."
    write_atomically(out, "\n".join([head, "", *lines, "", "- " + provenance_line(run)]) + "\n")


if __name__ == "__main__":
    sys.exit(main())
