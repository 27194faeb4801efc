"""What the tests share: building MoA and MoH models in-process, running the real CLIs, the shared data.

The default run (``pytest tests``) is the fast in-process set; tests marked ``slow`` (subprocess
CLIs, recipes, benchmark smoke runs) run with ``pytest -m slow -n 2 --dist loadfile tests``.
``pytest.ini`` puts the repository root on the path, so ``benchmarks`` imports as a package (tests may
use its harness).
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import moa  # noqa: F401  (registers the plugin)
from benchmarks.harness.results import ROOT, shared_data
from moa.models.build import build_translation_model, dictionary_of_size
from moa_tools import fairseq_command


def needs_shared(*parts):
    """Skip unless ``parts`` exists under the shared data folder; returns (mark, path)."""
    path = shared_data(*parts)
    return pytest.mark.skipif(not os.path.exists(path), reason=f"{path} is not on this machine"), path


def run_cli(*args, check=True, input=None, cwd=None):
    """Run a console script installed beside this Python (or ``bash SCRIPT``) with the venv on PATH."""
    command = [fairseq_command(args[0]), *args[1:]] if args[0] != "bash" else list(args)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(command, capture_output=True, text=True, input=input, cwd=cwd, env=env)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def sacrebleu_sgm_text(sgm_file, tmp_path):
    """The plain text sacreBLEU itself makes of a WMT .sgm file (its own converter, no download)."""
    from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

    from moa_tools.textio import read_lines

    out = str(tmp_path / (os.path.basename(sgm_file) + ".sacrebleu.txt"))
    FakeSGMLDataset._convert_format(FakeSGMLDataset.__new__(FakeSGMLDataset), sgm_file, out)
    return list(read_lines(out))


def baseline_bits(dictionary_file: str):
    """(uniform, unigram) cross-entropy in bits of the two models that ignore context, from a fairseq
    dictionary's counts: every symbol equally likely (log2 |V|, the special symbols included), and each word
    at its training frequency (the counts' entropy). A trained model's loss beats the first at once and the
    second once it uses context."""
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(dictionary_file)
    counts = torch.tensor([c for c in dictionary.count[dictionary.nspecial:] if c > 0], dtype=torch.float64)
    p = counts / counts.sum()
    return math.log2(len(dictionary)), float(-(p * p.log2()).sum())


def build_model(arch: str, dict_size: int = 64, extra=()):
    """Build a registered fairseq model by arch name, as fairseq-train would, on a joined dictionary."""
    return build_translation_model(arch, dictionary_of_size(dict_size), extra)


def translation_sample(pad, batch=3, src_len=6, tgt_len=5):
    """A fixed batch for a 40-symbol joined dictionary, the first target padded at its end."""
    torch.manual_seed(5)
    src = torch.randint(4, 40, (batch, src_len))
    target = torch.randint(4, 40, (batch, tgt_len))
    target[0, -2:] = pad
    prev = torch.roll(target, 1, dims=1)
    prev[:, 0] = 2
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), src_len), "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(pad).sum()), "nsentences": batch}


def attention_parameters(d: int) -> int:
    """fairseq's MultiheadAttention of width d: W_q, W_k, W_v, W_o with biases."""
    return 4 * (d * d + d)


def moa_parameters(d: int, experts: int, head_dim: int) -> int:
    """An MoA module without biases: router W_g (E x d), W_q and W_o (d x E x D each), shared W_k and W_v (d x D)."""
    return experts * d + 2 * d * experts * head_dim + 2 * d * head_dim


def translation_parameters(vocab: int, d: int, ffn: int, layers: int, attention: int) -> int:
    """A post-norm encoder-decoder Transformer with all embeddings shared (one vocab x d matrix, sinusoidal
    positions) and ``attention`` parameters per attention module: an encoder layer is self-attention, the FFN
    (two linear maps with biases) and 2 LayerNorms; a decoder layer adds cross-attention and a third LayerNorm."""
    feed_forward, layer_norm = 2 * d * ffn + ffn + d, 2 * d
    encoder_layer = attention + feed_forward + 2 * layer_norm
    decoder_layer = 2 * attention + feed_forward + 3 * layer_norm
    return vocab * d + layers * (encoder_layer + decoder_layer)


TINY_SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
              "--encoder-ffn-embed-dim", "64", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
              "--dropout", "0", "--attention-dropout", "0", "--encoder-attention-heads", "2",
              "--decoder-attention-heads", "2"]
# A drawn router, not the default zero one: at initialisation every token then routes differently,
# so the tests of untrained models see real routing instead of every token taking the same experts.
TINY = TINY_SHAPE + ["--moa-router-init", "normal"]
TINY_MOH = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
            "--dropout", "0", "--attention-dropout", "0"]
