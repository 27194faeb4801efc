"""Damaged inputs, made systematically, through the entry points that read them: every run ends in a named
error (exit non-zero, the damaged file named, no traceback) or in the undamaged run's result, and leaves
nothing half-written. The table of outcomes is docs/troubleshooting.md's "Damaged inputs".

Input kinds: a translation split's .idx and .bin, a language-model split's .idx and .bin, a dictionary, a
checkpoint, a sentencepiece model, a raw parallel corpus. Damages: cut at half, cut by its last byte,
emptied, a byte flipped (in a .bin, the high byte of a token id), swapped with another file of its kind,
missing."""

import os
import re
import shutil

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow
TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8", "--share-all-embeddings"]
COMMON = ["--cpu", "--num-workers", "0", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1000",
          "--max-update", "2", "--seed", "1", "--no-epoch-checkpoints"]
LM = ["--task", "language_modeling", "--arch", "moa_lm_small", "--decoder-layers", "1", "--decoder-embed-dim", "32",
      "--decoder-ffn-embed-dim", "64", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
      "--criterion", "moa_cross_entropy", "--tokens-per-sample", "32"]
DAMAGES = ["cut at half", "cut by its last byte", "emptied", "a byte flipped", "swapped", "missing"]


def damage(path, how, other):
    """Damage ``path`` as ``how`` says; ``other``: a file of the same kind to swap in."""
    data = open(path, "rb").read()
    if how == "missing":
        os.remove(path)
        return
    if how == "swapped":
        shutil.copyfile(other, path)
        return
    if how == "a byte flipped":
        at = len(data) // 2
        if path.endswith(".bin"):
            at |= 1  # the high byte of a little-endian uint16 token id
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    else:
        data = {"cut at half": data[:len(data) // 2], "cut by its last byte": data[:-1], "emptied": b""}[how]
    open(path, "wb").write(data)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    work = tmp_path_factory.mktemp("damaged")
    raw = str(work / "raw")
    write_corpus(raw, {"train": 300, "valid": 20, "test": 21}, seed=9)
    mt, lm = str(work / "mt"), str(work / "lm")
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", mt, "--joined-dictionary",
            "--workers", "1")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", f"{raw}/train.de", "--validpref", f"{raw}/valid.de",
            "--testpref", f"{raw}/test.de", "--destdir", lm, "--workers", "1")
    run_cli("fairseq-train", mt, "--user-dir", USER_DIR, "--arch", "moa_small", *TINY, *COMMON,
            "--save-dir", str(work / "mt-ckpt"))
    run_cli("fairseq-train", lm, "--user-dir", USER_DIR, *LM, *COMMON, "--save-dir", str(work / "lm-ckpt"))
    mirror = work / "mirror"  # Multi30k's file names, for prepare-multi30k.sh
    mirror.mkdir()
    for split, name in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        for lang in ("en", "de"):
            shutil.copyfile(f"{raw}/{split}.{lang}", mirror / f"{name}.{lang}")
    # a sentencepiece model records the paths it was trained from: relative ones keep its bytes, and so the byte
    # that "a byte flipped" flips, the same wherever the test runs (a pytest-xdist worker's folder is longer)
    run_cli("moa-corpus", "spm-train", "--model-prefix", "spm", "--vocab-size", "100", "raw/train.en", cwd=str(work))
    return {"work": work, "raw": raw, "mt": mt, "lm": lm, "mt_ckpt": str(work / "mt-ckpt" / "checkpoint_last.pt"),
            "lm_ckpt": str(work / "lm-ckpt" / "checkpoint_last.pt"), "mirror": str(mirror),
            "spm": str(work / "spm.model")}


def _copy(made, tmp_path, key):
    """A private copy of the fixture's file or folder ``key``."""
    source = made[key]
    target = str(tmp_path / os.path.basename(source))
    (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, target)
    return target


# kind -> (what is copied, the damaged file in it, the file swapped in, the command, what the command writes)
def _case(made, tmp_path, kind):
    out = str(tmp_path / "out")
    generate = ["fairseq-generate", "{mt}", "--user-dir", USER_DIR, "--cpu", "--path", "{mt_ckpt}", "--gen-subset",
                "valid", "--beam", "2", "--batch-size", "8"]
    eval_lm = ["fairseq-eval-lm", "{lm}", "--user-dir", USER_DIR, "--cpu", "--path", "{lm_ckpt}", "--gen-subset",
               "test", "--tokens-per-sample", "32", "--max-tokens", "512"]
    cases = {
        "translation .idx": ("mt", "train.en-de.en.idx", "test.en-de.en.idx",
                             ["fairseq-train", "{mt}", "--user-dir", USER_DIR, "--arch", "moa_small", *TINY, *COMMON,
                              "--save-dir", out]),
        "translation .bin": ("mt", "valid.en-de.de.bin", "test.en-de.de.bin", generate),
        "language-model .idx": ("lm", "test.idx", "valid.idx", eval_lm),
        "language-model .bin": ("lm", "test.bin", "valid.bin", eval_lm),
        "dictionary": ("mt", "dict.de.txt", os.path.join(made["lm"], "dict.txt"), generate),
        "checkpoint": ("mt_ckpt", None, made["lm_ckpt"], generate),
        "sentencepiece model": ("spm", None, os.path.join(made["mt"], "dict.en.txt"),
                                ["moa-corpus", "spm-encode", "--model", "{spm}", os.path.join(made["raw"], "test.en"),
                                 os.path.join(out, "test.en")]),
        "raw parallel corpus": ("mirror", "val.de", os.path.join(made["mirror"], "test_2016_flickr.de"),
                                ["bash", "examples/translation/prepare-multi30k.sh", "--mirror", "{mirror}", "--out",
                                 out, "--vocab-size", "100", "--workers", "1"]),
    }
    key, name, other, command = cases[kind]
    if kind == "sentencepiece model":
        os.makedirs(out)  # spm-encode writes into a folder that is there
    copy = _copy(made, tmp_path, key)
    fields = dict(made, **{key: copy})
    damaged = os.path.join(copy, name) if name else copy
    if other and not os.path.isabs(other):
        other = os.path.join(copy, other)
    return damaged, other, [arg.format(**fields) for arg in command], out


def _run(command):
    from helpers import ROOT

    return run_cli(*command, check=False, cwd=ROOT) if command[0] == "bash" else run_cli(*command, check=False)


KINDS = ["translation .idx", "translation .bin", "language-model .idx", "language-model .bin", "dictionary",
         "checkpoint", "sentencepiece model", "raw parallel corpus"]


@pytest.fixture(scope="module")
def undamaged(made, tmp_path_factory):
    """Each kind's command on its undamaged input: the result a damaged run must equal where it succeeds."""
    results = {}
    for kind in KINDS:
        tmp = tmp_path_factory.mktemp(kind.replace(" ", "-").replace(".", ""))
        _, _, command, out = _case(made, tmp, kind)
        proc = _run(command)
        assert proc.returncode == 0, (kind, proc.stderr[-3000:])
        results[kind] = _result(proc, out)
    return results


def _result(proc, out):
    """What a run gives: hypotheses, a loss, or the files it wrote (names and bytes)."""
    text = proc.stdout + proc.stderr
    figures = re.findall(r"^H-\d+\t.*$|Loss \(base 2\): [\d.]+|\| valid \| .*? \| loss [\d.]+", text, re.M)
    files = {}
    for root, _, names in os.walk(out):
        for name in names:
            if name.endswith((".log", ".pt")):
                continue  # times and weights trained on other batches are not the result compared
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), out)] = f.read()
    return figures, files


OUTCOMES = {}  # (kind, damage) -> "named error" or "same result as undamaged", for the guide's table


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_input_gives_a_named_error_or_the_right_result(made, undamaged, kind, how, tmp_path):
    damaged, other, command, out = _case(made, tmp_path, kind)
    damage(damaged, how, other)
    proc = _run(command)
    name = os.path.basename(damaged)
    if proc.returncode == 0:
        assert _result(proc, out) == undamaged[kind], f"{kind}, {how}: exit 0 with another result"
        OUTCOMES[(kind, how)] = "same result as undamaged"
        return
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert "Traceback" not in proc.stderr, f"{kind}, {how}: a traceback\n{proc.stderr[-3000:]}"
    assert "error" in last and name in last, f"{kind}, {how}: the last line does not name {name}:\n{last}"
    written = [os.path.join(root, f) for root, _, files in os.walk(out) for f in files]
    assert not [f for f in written if f.endswith((".tmp", ".part", ".pt", ".bin", ".idx"))
                or f == os.path.join(out, "test.en")], f"{kind}, {how}: output left behind: {written}"
    OUTCOMES[(kind, how)] = "named error"


def test_a_split_binarised_from_an_empty_file_is_named(made, tmp_path):
    """fairseq-preprocess writes an empty split from an empty text; training on it is refused by name."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for lang in ("en", "de"):
        shutil.copyfile(os.path.join(made["raw"], f"train.{lang}"), raw / f"train.{lang}")
        (raw / f"valid.{lang}").write_text("")
    data = str(tmp_path / "bin")
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--destdir", data, "--joined-dictionary", "--workers", "1")
    proc = run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "moa_small", *TINY, *COMMON,
                   "--save-dir", str(tmp_path / "out"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "valid.en-de.en.idx: holds no sentences: it was binarised from an empty file. The data-bin is damaged or "
        "mixed up: prepare the data again from a corpus with sentences in every split"), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_a_language_pair_whose_sides_differ_in_length_is_named(made, tmp_path):
    """Both files of the target side swapped for another split's (21 sentences against the source's 20): each
    file agrees with the other, and fairseq alone asserts; the two sides are named."""
    data = _copy(made, tmp_path, "mt")
    for ext in (".idx", ".bin"):
        shutil.copyfile(os.path.join(data, "test.en-de.de" + ext), os.path.join(data, "valid.en-de.de" + ext))
    proc = run_cli("fairseq-generate", data, "--user-dir", USER_DIR, "--cpu", "--path", made["mt_ckpt"],
                   "--gen-subset", "valid", "--beam", "2", "--batch-size", "8", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "valid.en-de.en and " in last and "valid.en-de.de: hold 20 and 21 sentences" in last, last


GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "troubleshooting.md")


def outcome_table(outcomes):
    """The guide's table: a row per input kind, a column per damage."""
    short = {"named error": "named error", "same result as undamaged": "same result"}
    lines = ["| input | " + " | ".join(DAMAGES) + " |", "|---|" + "---|" * len(DAMAGES)]
    for kind in KINDS:
        lines.append(f"| {kind} | " + " | ".join(short[outcomes[(kind, how)]] for how in DAMAGES) + " |")
    return "\n".join(lines)


def test_the_guide_states_every_outcome():
    """docs/troubleshooting.md's table is this run's outcomes (after every case above has run)."""
    if len(OUTCOMES) < len(KINDS) * len(DAMAGES):
        pytest.skip("runs with the whole module: every case first")
    table = outcome_table(OUTCOMES)
    with open(GUIDE, encoding="utf-8") as f:
        assert table in f.read(), f"the guide's table of damaged inputs should read:\n{table}"
