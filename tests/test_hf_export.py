"""moa-export-hf: the exported folder loads with transformers in a process where fairseq and moa cannot be
imported and gives the fairseq model's outputs for every family (dense, MoA, MoH, SwitchHead): language models'
log-probabilities (within 1e-4) and generate on the key/value cache, translation models' teacher-forced
log-probabilities and fairseq-generate's beam hypotheses, masked LMs' logits; a forward with labels returns the
training objective (the checkpoint's criterion's weights); transformers' Trainer fine-tunes MoA and MoH; the
sentencepiece tokenizer gives fairseq's ids; bad inputs are named errors that leave nothing behind."""

import json
import os

import pytest
import torch

from benchmarks.harness.isolation import run_without_fairseq
from helpers import run_cli

pytest.importorskip("transformers")

import moa  # noqa: E402,F401
from moa.models.build import build_from_args, dictionary_of_size, model_args  # noqa: E402
from moa.models.routed_transformer import pop_named_routings  # noqa: E402

TINY = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "4", "--dropout", "0.1", "--attention-dropout", "0.1"]
FAMILIES = {
    "transformer_lm_small": [],
    "moa_lm_small": ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8", "--moa-router-init", "normal"],
    "moh_lm_small": ["--moh-shared-heads", "1", "--moh-top-k-per-layer", "1,2"],
    "moh_lm_small/query-norm": ["--moh-shared-heads", "2", "--moh-top-k", "1", "--moh-router", "query-norm"],  # converted
    "switchhead_lm_small": ["--switchhead-experts", "4", "--switchhead-top-k", "2", "--switchhead-head-dim", "8"],
}
VOCAB = 48
CRITERION = {"_name": "moa_cross_entropy", "moa_alpha": 0.02, "moa_beta": 0.003, "moh_beta": 0.05}  # not the defaults

CHILD = r'''
import sys
import torch
from transformers import AutoModelForCausalLM

folder, tokens_file, out_file = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokens = torch.load(tokens_file, weights_only=True)
with torch.no_grad():
    out = model(tokens, labels=tokens)
torch.save({"logits": out.logits, "lm_loss": out.lm_loss, "aux_loss": out.aux_loss}, out_file)
'''


def built(arch, flags, seed):
    """The fairseq model of ``arch`` (``/...`` a variant) with ``flags`` on a dictionary of VOCAB symbols, its
    routers drawn wide so that they route tokens apart; returns (args, dictionary, model)."""
    torch.manual_seed(seed)
    args = model_args(arch.split("/")[0], flags)
    args.tokens_per_sample = args.max_target_positions = 64
    dictionary = dictionary_of_size(VOCAB)
    model = build_from_args(args, dictionary)
    for module in model.modules():
        if hasattr(module, "router") and hasattr(module.router, "parameters"):
            for p in module.router.parameters():
                torch.nn.init.normal_(p, std=1.0)
    return args, dictionary, model


def tiny_checkpoint(folder, arch, seed=0):
    """A fairseq checkpoint of a freshly built ``arch`` (its arguments as fairseq-train saves them) and its
    data-bin's dict.txt; returns (checkpoint, data_bin, the fairseq model)."""
    args, dictionary, model = built(arch, TINY + FAMILIES[arch], seed)
    data_bin = folder / "data-bin"
    data_bin.mkdir(parents=True)
    dictionary.save(str(data_bin / "dict.txt"))
    checkpoint = folder / "checkpoint.pt"
    torch.save({"cfg": {"model": args, "criterion": CRITERION}, "model": model.state_dict()}, checkpoint)
    return str(checkpoint), str(data_bin), model.eval()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_exported_model_loads_without_fairseq_and_gives_fairseq_log_probabilities(arch, tmp_path):
    checkpoint, data_bin, model = tiny_checkpoint(tmp_path, arch)
    out_dir = tmp_path / "hf"
    proc = run_cli("moa-export-hf", checkpoint, data_bin, str(out_dir))
    assert "language model" in proc.stdout
    files = set(os.listdir(out_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "modeling_moa_fairseq.py"} <= files
    assert json.loads((out_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_moa_fairseq.MoaFairseqForCausalLM"
    torch.manual_seed(1)
    tokens = torch.randint(4, VOCAB, (3, 20))
    tokens[1, -4:] = 1  # padding at the end of a shorter line, as fairseq pads
    torch.save(tokens, tmp_path / "tokens.pt")
    child = run_without_fairseq(CHILD, str(out_dir), str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt"),
                                cwd=str(tmp_path))
    assert child.returncode == 0, child.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        expected = model(tokens)[0]
    real = tokens.ne(1)
    difference = (got["logits"].log_softmax(-1) - expected.log_softmax(-1)).abs()[real]
    assert difference.max() < 1e-4, difference.max()
    # the objective: fairseq's next-token NLL (nats) over real tokens, plus the routers' terms
    target = tokens[:, 1:]
    nll = torch.nn.functional.cross_entropy(expected[:, :-1].reshape(-1, VOCAB), target.reshape(-1), ignore_index=1)
    assert abs(float(got["lm_loss"]) - float(nll)) < 1e-5
    # the routers' terms, weighted as the checkpoint's criterion weighs them (MoA: per module; MoH: the mean)
    routings = [r for _, r in pop_named_routings(model)]
    moa_terms = [CRITERION["moa_alpha"] * r.load_balancing_loss + CRITERION["moa_beta"] * r.router_z_loss
                 for r in routings if r.family == "MoA"]
    moh_terms = [r.balance_loss for r in routings if r.family == "MoH" and r.balance_loss is not None]
    expected_aux = float(sum(moa_terms)) + (CRITERION["moh_beta"] * float(torch.stack(moh_terms).mean())
                                            if moh_terms else 0.0)
    assert abs(float(got["aux_loss"]) - expected_aux) < 1e-6
    assert (expected_aux > 0) == (arch.startswith(("moa", "moh")) and "query-norm" not in arch)


def test_the_comparison_sees_another_model(tmp_path):
    """The log-probability check fails for a model exported from other weights (a seed apart)."""
    checkpoint, data_bin, _ = tiny_checkpoint(tmp_path / "a", "switchhead_lm_small", seed=0)
    _, _, other = tiny_checkpoint(tmp_path / "b", "switchhead_lm_small", seed=1)
    run_cli("moa-export-hf", checkpoint, data_bin, str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    tokens = torch.randint(4, VOCAB, (2, 12))
    with torch.no_grad():
        assert (exported(tokens).logits.log_softmax(-1) - other(tokens)[0].log_softmax(-1)).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["moa_lm_small", "moh_lm_small"])
def test_trainer_fine_tunes_an_exported_moa_and_moh_model(arch, tmp_path):
    """transformers.Trainer on the exported model: the loss (cross-entropy plus MoA's alpha L_a + beta L_z,
    MoH's beta L_b) falls over a few steps on a repeated batch, and the routing is in the outputs."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    checkpoint, data_bin, _ = tiny_checkpoint(tmp_path, arch)
    run_cli("moa-export-hf", checkpoint, data_bin, str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    torch.manual_seed(2)
    rows = torch.randint(4, VOCAB, (8, 16))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    arguments = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=8,
                                  max_steps=12, learning_rate=5e-3, logging_steps=1, report_to=[], save_strategy="no",
                                  use_cpu=True, seed=3)
    trainer = Trainer(model=model, args=arguments, train_dataset=Rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    out = model(rows[:2], labels=rows[:2])
    assert out.routing and out.routing[0].family == arch[:3].replace("moa", "MoA").replace("moh", "MoH")
    assert out.aux_loss > 0


def test_sentencepiece_tokenizer_encodes_raw_text_to_fairseqs_ids(tmp_path):
    """With --sentencepiece-model, AutoTokenizer encodes raw text as the recipes do (sentencepiece pieces,
    fairseq's dictionary, </s>) and decodes as fairseq's --post-process sentencepiece."""
    import sentencepiece
    from fairseq.data import Dictionary
    from transformers import AutoTokenizer

    text = tmp_path / "text.txt"
    lines = [f"the {w} was released in {1990 + i} and sold {i} copies" for i, w in
             enumerate(["game", "album", "film", "book", "song"] * 20)]
    text.write_text("\n".join(lines) + "\n")
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "spm"), vocab_size=60,
                                             model_type="bpe", character_coverage=1.0)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    dictionary = Dictionary()
    for line in lines:
        dictionary.encode_line(" ".join(sp.encode(line, out_type=str)), add_if_not_exist=True)
    checkpoint, data_bin, _ = tiny_checkpoint(tmp_path, "moa_lm_small")
    dictionary.finalize(padding_factor=VOCAB)  # the checkpoint's size
    assert len(dictionary) == VOCAB
    dictionary.save(os.path.join(data_bin, "dict.txt"))
    run_cli("moa-export-hf", checkpoint, data_bin, str(tmp_path / "hf"), "--sentencepiece-model",
            str(tmp_path / "spm.model"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    for raw in ("the film was released in 1993", "a book nobody sold"):
        expected = dictionary.encode_line(" ".join(sp.encode(raw, out_type=str)), add_if_not_exist=False).tolist()
        ids = tokenizer(raw).input_ids
        assert ids == expected
        assert tokenizer.decode(ids[:-1]) == dictionary.string(torch.tensor(expected),
                                                                                   "sentencepiece")


@pytest.mark.parametrize("damage", ["unknown-arch", "foreign-dictionary", "missing-sentencepiece", "non-empty-out"])
def test_bad_input_is_named_and_leaves_nothing(damage, tmp_path):
    checkpoint, data_bin, _ = tiny_checkpoint(tmp_path / "lm", "moa_lm_small")
    out_dir, extra = tmp_path / "out" / "hf", []
    (tmp_path / "out").mkdir()
    if damage == "unknown-arch":
        state = torch.load(checkpoint, weights_only=True)
        state["cfg"]["model"].arch = "lstm"
        torch.save(state, checkpoint)
        expected = "is not exported"
    elif damage == "foreign-dictionary":
        dictionary_of_size(VOCAB + 8).save(os.path.join(data_bin, "dict.txt"))
        expected = "give the data-bin the model was trained on"
    elif damage == "missing-sentencepiece":
        extra = ["--sentencepiece-model", str(tmp_path / "nowhere.model")]
        expected = "no such sentencepiece model"
    else:
        out_dir.mkdir()
        (out_dir / "keep.txt").write_text("a user's file\n")
        expected = "exists and is not empty"
    before = sorted(os.listdir(tmp_path / "out"))
    proc = run_cli("moa-export-hf", checkpoint, data_bin, str(out_dir), *extra, check=False)
    assert proc.returncode == 1 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "out")) == before  # no temporary folder, no half-written OUT_DIR
    if damage == "non-empty-out":
        assert os.listdir(out_dir) == ["keep.txt"]


TRANSLATION_TINY = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
                    "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                    "--dropout", "0.1", "--attention-dropout", "0.1"]
TRANSLATION_FAMILIES = {
    "transformer": ["--encoder-normalize-before", "--decoder-normalize-before"],  # the dense twin, pre-norm
    "moa_small": ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8", "--moa-router-init", "normal"],
    "moa_small/self-only": ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
                            "--moa-attention-types", "encoder-self,decoder-self"],  # dense cross-attention
    "moh_small": ["--moh-shared-heads", "1", "--moh-top-k", "2"],
    "switchhead_small": ["--switchhead-experts", "4", "--switchhead-top-k", "2", "--switchhead-head-dim", "8"],
}
BEAM = dict(beam=4, lenpen=0.6, max_len_b=20)  # the exported defaults but a short maximum (random weights)

TRANSLATION_CHILD = r'''
import sys
import torch
from transformers import AutoModelForSeq2SeqLM

folder, tensors_file, out_file = sys.argv[1:4]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
t = torch.load(tensors_file, weights_only=True)
with torch.no_grad():
    out = model(t["source"], labels=t["target"])
    hypotheses = model.generate(t["source"], max_len_b=20, num_return_sequences=2)
    lenpen_1 = model.generate(t["source"], max_len_b=20, length_penalty=1.0)
torch.save({"logits": out.logits, "lm_loss": out.lm_loss, "aux_loss": out.aux_loss, "hypotheses": hypotheses,
            "lenpen_1": lenpen_1,
            "num_beams": model.generation_config.num_beams, "length_penalty": model.generation_config.length_penalty},
           out_file)
'''


def tiny_translation_checkpoint(folder, arch, seed=0):
    """A fairseq checkpoint of a freshly built translation ``arch`` on a joined en-de dictionary; returns
    (checkpoint, data_bin, the fairseq model)."""
    from argparse import Namespace

    args, dictionary, model = built(arch, TRANSLATION_TINY + TRANSLATION_FAMILIES[arch], seed)
    with torch.no_grad():  # a large EOS row, so that hypotheses end at different lengths (some at the maximum)
        model.decoder.embed_tokens.weight[dictionary.eos()] *= 3
    data_bin = folder / "data-bin"
    data_bin.mkdir(parents=True)
    for lang in ("en", "de"):
        dictionary.save(str(data_bin / f"dict.{lang}.txt"))
    checkpoint = folder / "checkpoint.pt"
    torch.save({"cfg": {"model": args, "task": Namespace(source_lang="en", target_lang="de")},
                "model": model.state_dict()}, checkpoint)
    return str(checkpoint), str(data_bin), model.eval(), dictionary


def fairseq_beam(model, dictionary, source, **settings):
    """fairseq-generate's hypotheses (token lists, best first) for right-padded ``source``, fed as fairseq
    feeds it (left-padded)."""
    from fairseq.sequence_generator import SequenceGenerator

    lengths = source.ne(1).sum(1)
    left = torch.full_like(source, 1)
    for i, n in enumerate(lengths.tolist()):
        left[i, source.size(1) - n:] = source[i, :n]
    generator = SequenceGenerator([model], dictionary, beam_size=settings["beam"], len_penalty=settings["lenpen"],
                                  max_len_b=settings["max_len_b"])
    sample = {"net_input": {"src_tokens": left, "src_lengths": lengths}}
    return [[h["tokens"].tolist() for h in hyps] for hyps in generator.generate([model], sample)]


@pytest.mark.parametrize("arch", list(TRANSLATION_FAMILIES))
def test_exported_translation_model_gives_fairseqs_log_probabilities_and_beam_hypotheses(arch, tmp_path):
    """Loaded where fairseq and moa cannot be imported: teacher-forced log-probabilities within 1e-4 of
    fairseq's, and generate() (the exported beam 4, length penalty 0.6) gives fairseq's SequenceGenerator's
    hypotheses, the best two of each sentence, token for token; with length penalty 1.0 too, which changes
    MoA's hypotheses (the comparison sees the length penalty)."""
    checkpoint, data_bin, model, dictionary = tiny_translation_checkpoint(tmp_path, arch)
    out_dir = tmp_path / "hf"
    proc = run_cli("moa-export-hf", checkpoint, data_bin, str(out_dir))
    assert "translation model" in proc.stdout and "AutoModelForSeq2SeqLM" in proc.stdout
    torch.manual_seed(1)
    source = torch.randint(4, VOCAB, (12, 9))
    source[:, -1] = 2
    for i, n in enumerate([9, 5, 7, 3]):  # shorter sentences, right-padded
        source[i, n - 1], source[i, n:] = 2, 1
    target = torch.randint(4, VOCAB, (12, 7))
    target[:, -1] = 2
    target[0, 4], target[0, 5:] = 2, 1
    torch.save({"source": source, "target": target}, tmp_path / "tensors.pt")
    child = run_without_fairseq(TRANSLATION_CHILD, str(out_dir), str(tmp_path / "tensors.pt"), str(tmp_path / "out.pt"),
                                cwd=str(tmp_path))
    assert child.returncode == 0, child.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (got["num_beams"], got["length_penalty"]) == (4, 0.6)
    prev = torch.cat([torch.full((12, 1), 2), target[:, :-1]], 1)
    prev[0, 5] = 1  # fairseq's prev_output_tokens: EOS, the target without its EOS, padding
    with torch.no_grad():
        expected = model(source, source.ne(1).sum(1), prev)[0]
    real = target.ne(1)
    difference = (got["logits"].log_softmax(-1) - expected.log_softmax(-1)).abs()[real]
    assert difference.max() < 1e-4, difference.max()
    assert (float(got["aux_loss"]) > 0) == (not arch.startswith(("transformer", "switchhead")))
    beams = fairseq_beam(model, dictionary, source, **BEAM)
    rows = got["hypotheses"].tolist()
    for i, hypotheses in enumerate(beams):
        for j in range(2):
            row = rows[2 * i + j]
            assert row[0] == 2
            ours = row[1: row.index(2, 1) + 1]
            assert ours == hypotheses[j], (i, j, ours, hypotheses[j])
    assert min(len(h[0]) for h in beams) <= BEAM["max_len_b"]  # EOS decides, not the maximum length alone
    unpenalised = fairseq_beam(model, dictionary, source, **dict(BEAM, lenpen=1.0))
    assert [row[1: row.index(2, 1) + 1] for row in got["lenpen_1"].tolist()] == [h[0] for h in unpenalised]
    if arch == "moa_small":
        assert unpenalised != beams


@pytest.mark.parametrize("arch", ["moa_lm_small", "moh_lm_small", "switchhead_lm_small", "transformer_lm_small"])
def test_language_model_generate_runs_on_the_key_value_cache(arch, tmp_path):
    """transformers' generate (greedy and beam 3) on the cache gives what it gives running the whole prefix each
    step (fairseq's logits, checked above); MoA's cache holds its one shared key/value head, (B, T, D)."""
    from transformers import AutoModelForCausalLM

    checkpoint, data_bin, _ = tiny_checkpoint(tmp_path, arch)
    run_cli("moa-export-hf", checkpoint, data_bin, str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    torch.manual_seed(4)
    prompt = torch.randint(4, VOCAB, (2, 5))
    for beams in (1, 3):
        settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=beams, pad_token_id=1)
        cached = model.generate(prompt, **settings)
        assert cached.shape == (2, 17)
        assert torch.equal(cached, model.generate(prompt, use_cache=False, **settings))
    with torch.no_grad():
        out = model(prompt, cache={})
    assert out.cache["length"] == 5
    if arch == "moa_lm_small":
        keys = [v["prev_key"] for k, v in out.cache.items() if k != "length" and "prev_key" in v]
        assert len(keys) == 2 and all(k.dim() == 3 and k.shape[0] == 2 and k.shape[2] == 8 for k in keys)
    step = model(torch.cat([prompt, prompt[:, :1]], 1), cache=out.cache).logits
    full = model(torch.cat([prompt, prompt[:, :1]], 1)).logits
    assert step.shape == (2, 1, VOCAB) and (step[:, 0] - full[:, -1]).abs().max() < 1e-5


MLM_FAMILIES = {"roberta": [], "moa_roberta_small": ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8"],
                "moh_roberta_small": ["--moh-shared-heads", "1", "--moh-top-k", "2"]}
MLM_TINY = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
            "--encoder-attention-heads", "4", "--dropout", "0.1", "--attention-dropout", "0.1", "--max-positions", "64"]
MLM_CHILD = CHILD.replace("AutoModelForCausalLM", "AutoModelForMaskedLM").replace(
    "out = model(tokens, labels=tokens)", "out = model(tokens, labels=tokens.masked_fill(tokens.ne(VOCAB - 1), -100))"
).replace("import torch\n", "import torch\nVOCAB = int(sys.argv[4])\n", 1)


@pytest.mark.parametrize("arch", list(MLM_FAMILIES))
def test_exported_masked_lm_gives_fairseqs_logits(arch, tmp_path):
    """A RoBERTa masked LM (its dictionary plus the task's <mask>), loaded without fairseq or moa: logits within
    1e-4 of fairseq's, the loss over the masked positions, <mask> the tokenizer's mask token."""
    from fairseq.data import Dictionary
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    args = model_args(arch, MLM_TINY + MLM_FAMILIES[arch])
    dictionary = dictionary_of_size(VOCAB - 1)
    data_bin = tmp_path / "data-bin"
    data_bin.mkdir()
    dictionary.save(str(data_bin / "dict.txt"))
    mask = dictionary.add_symbol("<mask>")
    model = build_from_args(args, dictionary).eval()
    torch.save({"cfg": {"model": args}, "model": model.state_dict()}, tmp_path / "checkpoint.pt")
    proc = run_cli("moa-export-hf", str(tmp_path / "checkpoint.pt"), str(data_bin), str(tmp_path / "hf"))
    assert "masked LM" in proc.stdout
    tokens = torch.randint(4, VOCAB - 1, (3, 12))
    tokens[:, 3], tokens[:, -1], tokens[1, -3:] = mask, 2, 1
    torch.save(tokens, tmp_path / "tokens.pt")
    child = run_without_fairseq(MLM_CHILD, str(tmp_path / "hf"), str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt"),
                                str(VOCAB), cwd=str(tmp_path))
    assert child.returncode == 0, child.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        expected = model(tokens)[0]
    assert (got["logits"] - expected).abs()[tokens.ne(1)].max() < 1e-4
    nll = torch.nn.functional.cross_entropy(expected[:, 3], tokens[:, 3])
    assert abs(float(got["lm_loss"]) - float(nll)) < 1e-5
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.mask_token_id == mask == len(Dictionary.load(str(data_bin / "dict.txt")))
