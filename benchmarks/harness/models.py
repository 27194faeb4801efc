"""Models, batches, training steps and beam decoders built in-process, for timing.

:data:`SHAPES`: the Multi30k shape (``small``: d_model 256, 3+3 layers, 4 heads of 64, 8,000 symbols)
and the base shape (``models``: 6+6 layers, d_model 512, 32,768 symbols), each with the archs timed
there (the first is the reference), the batch, the length and the beam's sentences; ``experts``: MoA's
expert counts at the Multi30k shape.
"""

import os
import tempfile

import torch

import moa  # noqa: F401  (registers the plugin)
from moa.models.build import build_translation_model, dictionary_of_size

SMALL = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
         "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]  # fairseq's transformer at moa_small's shape
SHAPES = {  # name -> archs, extra flags, dictionary size, batch, length, beam sentences
    "small": (("transformer", "moa_small", "moh_small", "moh_small/query-norm", "switchhead_small",
               "switchhead_small/1H2K7E64D"),
              SMALL + ["--dropout", "0.3", "--attention-dropout", "0.1"], 8000, 128, 16, 32),
    "models": (("transformer_wmt_en_de", "moa_base", "moh_base", "switchhead_base"), [], 32768, 64, 32, 16),
    # MoA at k = 4 with 8 (moa_small), 4, 16 and 32 experts: the converged study's more-experts rows
    "experts": (("moa_small", "moa_small/4E", "moa_small/16E", "moa_small/32E"),
                SMALL + ["--dropout", "0.3", "--attention-dropout", "0.1"], 8000, 128, 16, 32),
}
VARIANTS = {  # model name -> (arch, its flags)
    # what moa-convert-moh makes of the Transformer at 75% of the heads with the parameter-free router
    "moh_small/query-norm": ("moh_small", ["--moh-router", "query-norm"]),
    # SwitchHead at the Transformer's parameters (the converged study's switchhead-params)
    "switchhead_small/1H2K7E64D": ("switchhead_small", ["--switchhead-heads", "1", "--switchhead-experts", "7",
                                                        "--switchhead-top-k", "2", "--switchhead-head-dim", "64"]),
    **{f"moa_small/{e}E": ("moa_small", ["--moa-experts", str(e)]) for e in (4, 16, 32)},
}


def shape_model(shape, name, device="cpu"):
    """The model ``name`` (an arch or one of :data:`VARIANTS`) at ``shape`` (:data:`SHAPES`), seed 0."""
    _, flags, dictionary_size, *_ = SHAPES[shape]
    arch, extra = VARIANTS.get(name, (name, []))
    torch.manual_seed(0)
    return build_translation_model(arch, dictionary_of_size(dictionary_size), flags + extra).to(device)


def dictionary_folder(size):
    """A temporary folder with the joined dictionaries (``dict.{en,de}.txt``, ``dict.txt``) of ``size`` symbols."""
    folder = tempfile.mkdtemp(prefix="moa-dict-")
    dictionary = dictionary_of_size(size)
    for name in ("dict.en.txt", "dict.de.txt", "dict.txt"):
        dictionary.save(os.path.join(folder, name))
    return folder


def synthetic_batch(model, bsz, src_len, tgt_len, device="cpu", seed=0):
    """A fairseq translation sample of random tokens: ``bsz`` sources of ``src_len``, targets of ``tgt_len``."""
    g = torch.Generator().manual_seed(seed)
    dictionary = model.decoder.dictionary
    src = torch.randint(4, len(dictionary), (bsz, src_len), generator=g).to(device)
    target = torch.randint(4, len(dictionary), (bsz, tgt_len), generator=g).to(device)
    prev = torch.roll(target, 1, dims=1)
    prev[:, 0] = dictionary.eos()
    return {"id": torch.arange(bsz), "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), src_len, device=device),
                                                   "prev_output_tokens": prev},
            "target": target, "ntokens": bsz * tgt_len, "nsentences": bsz}


def criterion_for(model, arch):
    """fairseq-train's criterion for ``arch``: label-smoothed cross-entropy (0.1), with the routed models'
    auxiliary losses (none for SwitchHead) for the plugin's archs."""
    from fairseq.criterions import CRITERION_REGISTRY

    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    name = "moa_label_smoothed_cross_entropy" if arch.startswith(("moa", "moh", "switchhead")) else "label_smoothed_cross_entropy"
    return CRITERION_REGISTRY[name](task, sentence_avg=False, label_smoothing=0.1)


def train_step(model, arch, sample, optimizer=True):
    """One update as fairseq-train makes it: criterion forward, backward and (``optimizer``) an Adam step."""
    criterion = criterion_for(model, arch)
    adam = torch.optim.Adam(model.parameters(), lr=1e-4) if optimizer else None

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        if adam is not None:
            adam.step()

    return step


def cached_attention_step(module, state, step):
    """A job that runs one incremental step of attention ``module`` on ``step`` (1 x batch x dim) after the
    keys and values already cached in ``state``, from a fresh copy of that cache each time."""
    def run():
        with torch.no_grad():
            module(step, step, step, incremental_state={key: dict(value) for key, value in state.items()},
                   need_weights=False)

    return run


def beam_decode(model, sample, sentences, length, beam=4):
    """Beam-``beam`` decoding of the first ``sentences`` sources, every hypothesis forced to ``length`` tokens."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=beam, max_len_a=0,
                                  max_len_b=length, min_len=length)
    src = sample["net_input"]["src_tokens"][:sentences]
    batch = {"net_input": {"src_tokens": src, "src_lengths": torch.full((sentences,), src.size(1), device=src.device)}}

    def decode():
        model.eval()
        with torch.no_grad():
            generator.generate([model], batch)

    return decode
