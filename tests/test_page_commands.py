"""Every command a user-facing page shows, as written: the fenced ``bash`` blocks of README.md, docs/*.md and
examples/*/README.md.

A page's runnable commands run in order, in a folder of their own, on tiny data (slow set); what the test puts
in place of the page's data and paths, and where it shortens a training, is in ``SANDBOX`` and
``SUBSTITUTIONS``, the one place. A command that needs GPUs, a download or WMT14/WikiText-103 scale is in
``CHECKED_ONLY`` with the reason, and its command line is checked (fast set): fairseq's own parser with
``--user-dir moa`` for fairseq's commands, the script's options and ``bash -n`` for a script, ``--help`` for
a console script. Decoded text (``D-`` and ``T-`` lines) must carry no subword marker: ``--remove-bpe`` on
this project's sentencepiece data leaves ``▁`` in.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, needs_shared, run_cli

PAGES = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)),
         *sorted(glob.glob("examples/*/README.md", root_dir=ROOT))]

# Commands that do not run here, by (page, the start of the command), and why; their command lines are checked.
CHECKED_ONLY = {
    ("README.md", "bash setup.sh && .venv/bin/moa-demo"): "the CI's setup; the demo runs in test_cli_end_to_end",
    ("README.md", "bash setup.sh && .venv/bin/python -m pytest"): "the CI runs it (.ci/run)",
    ("docs/converting-to-moh.md", "fairseq-train data-bin --user-dir moa PRINTED-FLAGS"): "flags printed by the "
                                                                                          "conversion, elided",
    ("docs/distributed-and-checkpoints.md", "examples/translation/train-wmt14.sh"): "8 or 16 GPUs and WMT14",
    ("docs/distributed-and-checkpoints.md", "torchrun"): "elided arguments; test_distributed_training runs it",
    ("docs/gpus-and-precision.md", "bash benchmarks/dev/gpu_check.sh"): "a CUDA GPU",
    ("docs/language-models.md", "moa-convert-moh"): "converts a transformer_lm; test_lm_cli runs it",
    ("docs/language-models.md", "fairseq-train data-bin --user-dir moa --task language_modeling PRINTED"): "elided",
    ("docs/training-and-decoding.md", "examples/translation/prepare-wmt14"): "downloads WMT14",
    ("docs/training-and-decoding.md", "examples/translation/train-wmt14.sh"): "8 GPUs and WMT14",
    ("docs/training-and-decoding.md", "examples/translation/evaluate.sh"): "WMT14 checkpoints; "
                                                                          "test_translation_recipes runs it",
    ("docs/training-and-decoding.md", "fairseq-train ... --criterion"): "elided arguments",
    ("docs/training-and-decoding.md", "examples/mlm/"): "WikiText-103 and a GPU-sized model; test_mlm runs them",
    ("examples/lm/README.md", "examples/lm/"): "WikiText-103 and a GPU-sized model; test_lm_cli runs them",
    ("examples/mlm/README.md", "examples/mlm/"): "WikiText-103 and a GPU-sized model; test_mlm runs them",
    ("examples/translation/README.md", "examples/translation/"): "downloads WMT14, 8 GPUs",
}

# What the runnable pages' folders hold, by page: name in the folder -> what the fixtures made.
SANDBOX = {
    "README.md": {"wmt14-en-de": "multi30k-en-de", "data-bin": "multi30k-en-de/data-bin",
                  "moa.pt": "moa/checkpoint_last.pt", "transformer.pt": "transformer/checkpoint_last.pt",
                  "test.de": "multi30k-en-de/raw/test_2016_flickr.de", "checkpoints/mlm": "mlm-checkpoint",
                  "checkpoints/lm": "lm-checkpoint", "wikitext-103": "lm", "wikitext-103-lm": "lm"},
    "docs/converting-to-moh.md": {"data-bin": "multi30k-en-de/data-bin", "checkpoints/transformer": "transformer"},
    "docs/hugging-face.md": {"wikitext-103-lm": "lm", "wikitext-103": "lm", "checkpoints/lm": "lm-checkpoint",
                             "checkpoints/mlm": "mlm-checkpoint", "multi30k-en-de": "multi30k-en-de",
                             "checkpoints/checkpoint_best.pt": "moa/checkpoint_best.pt"},
    "docs/language-models.md": {"data-bin": "lm/data-bin"},
    "docs/training-and-decoding.md": {"data-bin": "multi30k-en-de/data-bin", "moa.pt": "moa/checkpoint_last.pt",
                                      "moh.pt": "moh/checkpoint_last.pt",
                                      "transformer.pt": "transformer/checkpoint_last.pt",
                                      "test.de": "multi30k-en-de/raw/test_2016_flickr.de"},
    "examples/translation/README.md": {"raw": "demo-raw"},
}

# (regular expression, replacement) applied to every command that runs: tiny data, short trainings.
SUBSTITUTIONS = [
    (r"^(fairseq-train .*)$", r"\1 --max-epoch 2 --max-tokens 1024 --update-freq 1 --num-workers 0 "
                              r"--no-save-optimizer-state"),
    (r"^(fairseq-train .*--arch \w+_base .*)$", r"\1 --encoder-layers 1 --decoder-layers 1"),  # base archs: 1+1
    (r" \.\.\.( |$)", r" --optimizer adam --lr 1e-3\1"),
    (r"--max-update 400\b", "--max-update 4"),
    (r"--num-epoch-checkpoints 10\b", "--num-epoch-checkpoints 2"),
    (r"^(examples/translation/prepare-multi30k\.sh .*?)(\s*)$", r"\1 --mirror MINI_MIRROR --vocab-size 300"),
    (r"\bfairseq-(generate|interactive) ", r"fairseq-\1 --max-len-a 1 --max-len-b 5 --num-workers 0 "),
]


def page_commands(page):
    """(line, command) of each command in the page's fenced bash blocks: continuations joined, comments cut."""
    commands, block, pending, start = [], False, "", 0
    lines = open(os.path.join(ROOT, page), encoding="utf-8").read().splitlines()
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        text = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        command = (pending + text).strip()
        pending = ""
        if command:
            commands.append((start, re.sub(r"\s+", " ", command)))
    return commands


def checked_only(page, command):
    return next((why for (p, prefix), why in CHECKED_ONLY.items() if p == page and command.startswith(prefix)), None)


def runnable(page):
    return [command for _, command in page_commands(page) if not checked_only(page, command)]


def test_every_page_command_runs_or_is_checked_and_every_exception_is_used():
    pages = {page for page in PAGES if page_commands(page)}
    assert {"README.md", "docs/training-and-decoding.md", "examples/translation/README.md"} <= pages
    unplanned = [(page, command) for page in pages for command in runnable(page) if page not in SANDBOX]
    assert not unplanned, f"commands with no folder to run in: add the page to SANDBOX or CHECKED_ONLY: {unplanned}"
    used = {(p, prefix) for p, prefix in CHECKED_ONLY for page in PAGES for _, c in page_commands(page)
            if p == page and c.startswith(prefix)}
    assert used == set(CHECKED_ONLY), f"CHECKED_ONLY names commands no page shows: {set(CHECKED_ONLY) - used}"
    assert set(SANDBOX) == {page for page in pages if runnable(page)}


FAIRSEQ_PARSERS = {"fairseq-train": "get_training_parser", "fairseq-generate": "get_generation_parser",
                   "fairseq-interactive": "get_interactive_generation_parser", "fairseq-eval-lm": "get_eval_lm_parser",
                   "fairseq-validate": "get_validation_parser"}
PLACEHOLDERS = {"...", "PRINTED-FLAGS"}  # elided arguments; where they hide the arch, the parse gets a stand-in


def check_command_line(words):
    """Raise AssertionError when ``words`` (one program's command line) would not parse."""
    program, args = words[0], [w for w in words[1:] if w not in PLACEHOLDERS]
    if program == "torchrun":
        at = args.index("$(which")
        return check_command_line(["fairseq-train", *args[at + 2:]])
    if program in FAIRSEQ_PARSERS:
        from fairseq import options

        if args[0].startswith("-"):
            args = ["DATA", *args]
        if program == "fairseq-train" and "--arch" not in args:
            args += ["--arch", "moh_lm_small" if "language_modeling" in args else "moh_small"]
        parser = getattr(options, FAIRSEQ_PARSERS[program])()
        options.parse_args_and_arch(parser, input_args=args)
        return
    if program == "bash" and words[1].endswith(".sh"):
        return check_command_line(words[1:])
    if program.endswith(".sh"):
        script = open(os.path.join(ROOT, program), encoding="utf-8").read()
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, program)]).returncode == 0, program
        for flag in (w for w in args if w.startswith("--")):
            assert re.search(rf"(^|[\s|]){re.escape(flag)}\)", script, re.M), f"{program} takes no {flag}"
        return
    if program.startswith(".venv/bin/"):
        program = program[len(".venv/bin/"):]
        if program == "python":
            assert args[:2] == ["-m", "pytest"] and os.path.isdir(os.path.join(ROOT, args[-1])), words
            return
    if program == "setup.sh":
        assert os.path.exists(os.path.join(ROOT, "setup.sh"))
        return
    usage = run_cli(program, "--help").stdout
    for flag in (w for w in args if w.startswith("--")):
        assert flag in usage, f"{program} takes no {flag}"


@pytest.mark.parametrize("page", [p for p in PAGES if any(checked_only(p, c) for _, c in page_commands(p))])
def test_commands_that_cannot_run_here_parse(page):
    for line, command in page_commands(page):
        if checked_only(page, command):
            for part in command.split(" && "):
                words = shlex.split(part)
                try:
                    check_command_line(words)
                except (AssertionError, SystemExit) as error:
                    pytest.fail(f"{page}:{line}: {part}: {error!r}")


# Running them: the slow set.

needs_multi30k, MULTI30K = needs_shared("multi30k")
needs_wikitext, WIKITEXT = needs_shared("wikitext-2", "wiki.valid.tokens")


def _train(data_bin, save_dir, *args):
    run_cli("fairseq-train", data_bin, "--user-dir", os.path.join(ROOT, "moa"), *args, "--optimizer", "adam",
            "--lr", "1e-3", "--max-tokens", "1024", "--max-update", "4", "--cpu", "--num-workers", "0",
            "--save-dir", str(save_dir), "--no-epoch-checkpoints")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """What the pages' folders link to: a 200-sentence Multi30k En-De prepared by the recipe, the demo's corpus,
    WikiText-2 binarised for a language model, and models trained on them for a few updates (4: checkpoint_best
    is the last)."""
    from moa_tools.commands.demo import write_corpus

    root = tmp_path_factory.mktemp("made")
    mirror = root / "mini-mirror"
    mirror.mkdir()
    for split, n in (("train", 200), ("val", 50), ("test_2016_flickr", 50)):
        for lang in ("en", "de"):
            lines = open(os.path.join(MULTI30K, f"{split}.{lang}"), encoding="utf-8").read().splitlines()[:n]
            (mirror / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    m30k = root / "multi30k-en-de"
    run_cli("bash", os.path.join(ROOT, "examples", "translation", "prepare-multi30k.sh"), "--pair", "en-de",
            "--out", str(m30k), "--mirror", str(mirror), "--vocab-size", "300", "--workers", "1")
    data_bin = str(m30k / "data-bin")
    for name, arch in (("moa", "moa_small"), ("moh", "moh_small"), ("transformer", "transformer")):
        criterion = "moa_label_smoothed_cross_entropy" if name != "transformer" else "label_smoothed_cross_entropy"
        _train(data_bin, root / name, "--arch", arch, "--share-all-embeddings", "--criterion", criterion)
    write_corpus(str(root / "demo-raw"), {"train": 300, "valid": 50, "test": 50}, seed=1)
    words = open(WIKITEXT, encoding="utf-8").read().splitlines()
    (root / "lm-text").mkdir()
    for split, (a, b) in (("train", (0, 150)), ("valid", (150, 200)), ("test", (200, 250))):
        (root / "lm-text" / f"{split}.tokens").write_text("\n".join(words[a:b]) + "\n", encoding="utf-8")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", str(root / "lm-text" / "train.tokens"),
            "--validpref", str(root / "lm-text" / "valid.tokens"), "--testpref", str(root / "lm-text" / "test.tokens"),
            "--destdir", str(root / "lm" / "data-bin"), "--workers", "1")
    _train(str(root / "lm" / "data-bin"), root / "lm-checkpoint", "--task", "language_modeling", "--arch",
           "moa_lm_small", "--criterion", "moa_cross_entropy", "--tokens-per-sample", "64")
    _train(str(root / "lm" / "data-bin"), root / "mlm-checkpoint", "--task", "masked_lm", "--arch",
           "moa_roberta_small", "--criterion", "moa_masked_lm", "--tokens-per-sample", "64")
    return root


def page_script(page, mirror):
    lines = ["set -euo pipefail"]
    for command in runnable(page):
        for pattern, replacement in SUBSTITUTIONS:
            command = re.sub(pattern, replacement, command)
        lines.append(command.replace("MINI_MIRROR", str(mirror)))
    return "\n".join(lines) + "\n"


def decoded_lines(text, kinds=("D-",)):
    """The text of fairseq's output lines of ``kinds``: D- the detokenised hypothesis, T- the reference."""
    return [line.split("\t")[-1] for line in text.splitlines() if line.startswith(kinds)]


@pytest.mark.slow
@needs_multi30k
@needs_wikitext
@pytest.mark.parametrize("page", sorted(SANDBOX))
def test_page_commands_run_as_written(page, made, tmp_path):
    """The page's commands, in order, in one bash script; they must succeed and decode to plain text."""
    for name in ("moa", "examples", "benchmarks", ".venv"):
        (tmp_path / name).symlink_to(os.path.join(ROOT, name))
    for name, target in SANDBOX[page].items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(made / target)
    script = page_script(page, made / "mini-mirror")
    (tmp_path / "prompts.txt").write_text("A man is riding a bike .\nTwo dogs play in the snow .\n")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    with open(tmp_path / "prompts.txt") as prompts:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, stdin=prompts, capture_output=True,
                              text=True, timeout=1800)
    assert proc.returncode == 0, f"{page}:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    # a barely trained model's hypotheses may hold no word-initial piece; the references (T-) always do
    outputs = [proc.stdout] + [log.read_text(encoding="utf-8") for log in tmp_path.glob("*.log")]
    decoded = [line for text in outputs for line in decoded_lines(text)]
    plain = [line for text in outputs for line in decoded_lines(text, ("D-", "T-"))]
    assert all("▁" not in line and "@@" not in line for line in plain), (page, [p for p in plain if "▁" in p][:5])
    if re.search(r"fairseq-(generate|interactive)", script) and "language_modeling" not in script:
        assert any(line.strip() for line in decoded), f"{page}: nothing decoded\n{proc.stdout[-2000:]}"
    if page in ("README.md", "docs/hugging-face.md"):  # the exported model translates, from transformers
        for block in re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, page), encoding="utf-8").read(), re.S):
            if "AutoModelForSeq2SeqLM" in block:
                run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True)
                assert run.returncode == 0 and run.stdout.startswith("['"), (page, run.stderr[-3000:])
    if page == "docs/training-and-decoding.md":  # the page's own sentence, from Python as from fairseq-interactive
        import moa.hub

        m30k = tmp_path / "multi30k-en-de"
        translator = moa.hub.load_translator(str(tmp_path / "checkpoints" / "multi30k" / "checkpoint_best.pt"),
                                             str(m30k / "data-bin"), sentencepiece_model=str(m30k / "spm" / "spm.model"),
                                             cpu=True)
        ours = translator.translate("Two dogs play in the snow.", beam=4, lenpen=0.6, max_len_a=1, max_len_b=5)
        assert ours == decoded_lines(proc.stdout)[0]
