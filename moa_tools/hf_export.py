"""Export a fairseq checkpoint of the plugin to a Hugging Face model folder (``moa-export-hf``).

The folder holds what ``AutoModelFor...from_pretrained(OUT_DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)`` need, and nothing that imports fairseq or moa: ``config.json``
(with ``auto_map``), ``model.safetensors``, ``generation_config.json``, the tokenizer's files (token ids are
fairseq's dictionary ids) and the modelling code, :mod:`moa.modeling_moa_fairseq` with the torch-only
attention layers it imports (and, for sentencepiece data, :mod:`moa.tokenization_moa_fairseq`). Language
models, translation models (on one joined dictionary, as the recipes make them) and RoBERTa masked LMs are
exported, dense, MoA, MoH and SwitchHead, and MoH models made by ``moa-convert-moh``.
"""

import argparse
import json
import os
import shutil
import tempfile

from moa_tools import ToolError

MOA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moa")
# the modelling code and the torch-only layers it imports, copied beside the weights
CODE_FILES = ("configuration_moa_fairseq.py", "modeling_moa_fairseq.py", "fairseq_beam_search.py",
              "moa_attention.py", "moh_attention.py", "switchhead_attention.py", "routed_attention.py",
              "incremental_state.py", "routing.py", "dispatch.py", "experts.py")
FAMILY = {"transformer_lm": "transformer", "moa_lm": "moa", "moh_lm": "moh", "switchhead_lm": "switchhead",
          "transformer": "transformer", "moa_transformer": "moa", "moh_transformer": "moh",
          "switchhead_transformer": "switchhead", "roberta": "transformer", "moa_roberta": "moa", "moh_roberta": "moh"}
# kind -> (the fairseq models of that kind, the transformers class, its Auto class)
KINDS = {"language model": (("transformer_lm", "moa_lm", "moh_lm", "switchhead_lm"), "MoaFairseqForCausalLM",
                            "AutoModelForCausalLM"),
         "translation model": (("transformer", "moa_transformer", "moh_transformer", "switchhead_transformer"),
                               "MoaFairseqForConditionalGeneration", "AutoModelForSeq2SeqLM"),
         "masked LM": (("roberta", "moa_roberta", "moh_roberta"), "MoaFairseqForMaskedLM", "AutoModelForMaskedLM")}
# fairseq-generate's settings in the plugin's recipes: --beam 4 --lenpen 0.6, fairseq's maximum length 0 * src + 200
GENERATION = dict(num_beams=4, length_penalty=0.6, max_len_a=0, max_len_b=200, min_length=1)


def model_kind(args):
    """(kind, family) of a checkpoint's arguments: kind a key of :data:`KINDS`, family ``transformer``,
    ``moa``, ``moh`` or ``switchhead``; a ToolError naming what is not exported."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch)
    for kind, (models, _, _) in KINDS.items():
        if model in models:
            return kind, FAMILY[model]
    exported = ", ".join(m for models, _, _ in KINDS.values() for m in models)
    raise ToolError(f"the checkpoint's arch {arch!r} (model {model!r}) is not exported: moa-export-hf exports the "
                    f"models {exported} and their archs")


def constructor_arguments(module) -> dict:
    """The arguments that rebuild a routed attention module of the plugin (its weights, widths and role aside)."""
    from moa.moa_attention import MixtureOfAttentionHeads
    from moa.moh_attention import MixtureOfHeadsAttention

    if isinstance(module, MixtureOfAttentionHeads):
        return dict(num_experts=module.num_experts, top_k=module.top_k,
                    head_dim=module.head_dim, bias=module.k_proj.bias is not None,
                    gate_weights=module.router.gate_weights, router_init=module.router.init)
    if isinstance(module, MixtureOfHeadsAttention):
        router = "query-norm" if not hasattr(module.router, "gate_scale") else "learned"
        extra = {} if router == "query-norm" else dict(gate_scale=module.router.gate_scale,
                                                      balance_loss=module.router.balance_loss)
        return dict(num_heads=module.num_heads, shared_heads=module.shared_heads,
                    top_k=module.top_k, bias=module.k_proj.bias is not None, router=router, **extra)
    return dict(num_heads=module.num_heads, num_experts=module.num_experts,
                top_k=module.top_k, head_dim=module.head_dim,
                expert_dropout=module.output_router.expert_dropout)


def stack_config(stack, args, side: str, pad: int) -> dict:
    """One stack (a fairseq Transformer encoder or decoder module, ``side`` "encoder" or "decoder") as the
    config's dict: its shape read off the module and ``args``, each attention module's routed arguments."""
    from moa.routed_attention import RoutedAttention

    if getattr(stack, "project_in_dim", None) is not None or getattr(stack, "project_out_dim", None) is not None:
        raise ToolError("a decoder whose input or output width differs from its embedding width is not exported")
    if getattr(stack, "adaptive_softmax", None) is not None:
        raise ToolError("adaptive softmax is not exported")

    def recorded(name):
        modules = [getattr(layer, name, None) for layer in stack.layers]
        routed = [constructor_arguments(m) if isinstance(m, RoutedAttention) else None for m in modules]
        return None if all(r is None for r in routed) else routed

    positions = stack.embed_positions
    learned = positions is not None and hasattr(positions, "weight")
    return dict(embed_dim=stack.embed_tokens.embedding_dim, ffn_dim=getattr(args, f"{side}_ffn_embed_dim"),
                layers=len(stack.layers), attention_heads=getattr(args, f"{side}_attention_heads"),
                normalize_before=bool(getattr(args, f"{side}_normalize_before", False)),
                final_layer_norm=getattr(stack, "layer_norm", None) is not None, learned_positions=learned,
                max_positions=positions.weight.size(0) - pad - 1 if learned else stack.max_positions(),
                self_attention=recorded("self_attn"), cross_attention=recorded("encoder_attn"))


def aux_weights(state: dict) -> dict:
    """The routers' loss weights of the checkpoint's criterion (``--moa-alpha``, ``--moa-beta``, ``--moh-beta``),
    where it records them."""
    criterion = (state.get("cfg") or {}).get("criterion") or state.get("args")
    read = (lambda name: criterion.get(name)) if isinstance(criterion, dict) else \
        (lambda name: getattr(criterion, name, None))
    return {name: read(name) for name in ("moa_alpha", "moa_beta", "moh_beta") if read(name) is not None}


def hf_config(args, model, kind: str, family: str, vocab_size: int, pad: int, weights: dict):
    """The :class:`~moa.configuration_moa_fairseq.MoaFairseqConfig` of a fairseq ``model`` built from a
    checkpoint's ``args``."""
    from moa.configuration_moa_fairseq import MoaFairseqConfig

    if getattr(args, "adaptive_input", False) or getattr(args, "character_embeddings", False):
        raise ToolError("adaptive inputs and character embeddings are not exported")
    encoder = model.encoder.sentence_encoder if kind == "masked LM" else getattr(model, "encoder", None)
    decoder = model.decoder if kind != "masked LM" else None
    first = encoder if encoder is not None else decoder
    _, class_name, auto = KINDS[kind]
    return MoaFairseqConfig(
        vocab_size=vocab_size, family=family,
        encoder_stack=None if encoder is None else stack_config(encoder, args, "encoder", pad),
        decoder_stack=None if decoder is None else stack_config(decoder, args, "decoder", pad),
        activation_fn=getattr(args, "activation_fn", "relu"), dropout=args.dropout,
        attention_dropout=args.attention_dropout, activation_dropout=getattr(args, "activation_dropout", 0.0),
        layernorm_embedding=first.layernorm_embedding is not None, scale_embedding=first.embed_scale != 1.0,
        token_positions=first.embed_positions is not None,
        share_all_embeddings=bool(getattr(args, "share_all_embeddings", False)) and kind == "translation model",
        lm_head=kind == "masked LM", aux_weights=weights,
        tie_word_embeddings=kind == "masked LM" and not getattr(args, "untie_weights_roberta", False) or
        kind != "masked LM" and bool(getattr(args, "share_decoder_input_output_embed", False) or
                                     getattr(args, "share_all_embeddings", False)),
        auto_map={"AutoConfig": "configuration_moa_fairseq.MoaFairseqConfig", auto: f"modeling_moa_fairseq.{class_name}"},
        architectures=[class_name])


def dictionary_file(data_bin: str, state: dict, kind: str) -> str:
    """The data-bin's dictionary the checkpoint's model reads: ``dict.txt``, or for a translation model the
    joined ``dict.SRC.txt`` (which must equal ``dict.TGT.txt``)."""
    if kind != "translation model":
        path = os.path.join(data_bin, "dict.txt")
        if not os.path.isfile(path):
            raise ToolError(f"{data_bin} has no dict.txt: give the data-bin the model was trained on")
        return path
    paths = [os.path.join(data_bin, f"dict.{lang}.txt") for lang in translation_languages(data_bin, state)]
    if not all(os.path.isfile(p) for p in paths):
        raise ToolError(f"{data_bin} has no dict.SRC.txt and dict.TGT.txt: give the data-bin the model was trained on")
    with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
        if a.read() != b.read():
            raise ToolError(f"{paths[0]} and {paths[1]} differ: moa-export-hf exports translation models on one "
                            "joined dictionary (fairseq-preprocess --joined-dictionary, as the recipes make them)")
    return paths[0]


def translation_languages(data_bin: str, state: dict):
    """(source, target) language of a translation checkpoint: its task's, or as fairseq infers them from the
    data-bin's file names when the task left them out."""
    from fairseq.data.data_utils import infer_language_pair

    task = (state.get("cfg") or {}).get("task") or state.get("args")
    langs = [task.get(f"{side}_lang") if isinstance(task, dict) else getattr(task, f"{side}_lang", None)
             for side in ("source", "target")]
    return tuple(langs) if None not in langs else infer_language_pair(data_bin)


def word_tokenizer(dictionary, mask: bool):
    """A ``PreTrainedTokenizerFast`` of a fairseq dictionary: whitespace-separated symbols to their ids,
    ``</s>`` after each line (as fairseq binarises a line), ``<unk>`` for symbols not in it (``mask``: the
    masked-LM task's ``<mask>`` after the dictionary's symbols)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(dictionary.symbols)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=dictionary.unk_word))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {dictionary.eos_word}", special_tokens=[(dictionary.eos_word, dictionary.eos())])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=dictionary.bos_word,
                                   eos_token=dictionary.eos_word, unk_token=dictionary.unk_word,
                                   pad_token=dictionary.pad_word, model_input_names=["input_ids", "attention_mask"],
                                   **({"mask_token": "<mask>"} if mask else {}))


def sentencepiece_tokenizer(dictionary, dictionary_path: str, sentencepiece_model: str, mask: bool):
    """The exported :class:`~moa.tokenization_moa_fairseq.FairseqSentencePieceTokenizer` (raw text in), its
    symbols checked against fairseq's reading of the dictionary, id for id."""
    from moa.tokenization_moa_fairseq import FairseqSentencePieceTokenizer

    tokenizer = FairseqSentencePieceTokenizer(dictionary_path, sentencepiece_model,
                                              **({"mask_token": "<mask>"} if mask else {}))
    if tokenizer.symbols != dictionary.symbols:
        raise ToolError(f"{dictionary_path} reads differently in fairseq and in the exported tokenizer")
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["tokenization_moa_fairseq.FairseqSentencePieceTokenizer", None]}
    return tokenizer


def checkpoint_args(state: dict, checkpoint: str):
    """The model arguments a fairseq checkpoint records, as a namespace with ``arch``."""
    args = state.get("args") or (state.get("cfg") or {}).get("model")
    if args is None:
        raise ToolError(f"{checkpoint} records no model arguments: it was not written by fairseq-train")
    if isinstance(args, dict):  # a dataclass model's config (fairseq's transformer_lm): its arch is _name
        args = argparse.Namespace(**args)
        args.arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    return args


def export(checkpoint: str, data_bin: str, out_dir: str, sentencepiece_model: str = None) -> dict:
    """Write the Hugging Face folder of ``checkpoint`` (its dictionary read from ``data_bin``; its data's
    ``sentencepiece_model``, if any) to ``out_dir``, through a temporary folder moved into place at the end;
    returns what was written."""
    import copy

    from fairseq.data import Dictionary

    from moa.models.build import build_from_args
    from moa_tools.checkpoints import load_checkpoint

    if sentencepiece_model is not None and not os.path.isfile(sentencepiece_model):
        raise ToolError(f"no such sentencepiece model: {sentencepiece_model} (the recipes write it as "
                        "DATA/spm/spm.model)")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ToolError(f"{out_dir} exists and is not empty: name a new folder (nothing is overwritten)")
    state = load_checkpoint(checkpoint)
    args = checkpoint_args(state, checkpoint)
    kind, family = model_kind(args)
    path = dictionary_file(data_bin, state, kind)
    dictionary = Dictionary.load(path)
    if kind == "masked LM":
        dictionary.add_symbol("<mask>")  # as fairseq's masked_lm task does
    weights = state["model"]
    embeddings = next(k for k in ("decoder.embed_tokens.weight", "encoder.embed_tokens.weight",
                                  "encoder.sentence_encoder.embed_tokens.weight") if k in weights)
    if len(dictionary) != weights[embeddings].shape[0]:
        raise ToolError(f"{path} gives {len(dictionary)} symbols but the checkpoint's embeddings have "
                        f"{weights[embeddings].shape[0]} rows: give the data-bin the model was trained on")
    build_args = copy.deepcopy(args)  # the plain modules: no checkpointing wrapper, no compilation
    build_args.checkpoint_activations = build_args.offload_activations = build_args.compile_routed_attention = False
    fairseq_model = build_from_args(build_args, dictionary)
    config = hf_config(args, fairseq_model, kind, family, len(dictionary), dictionary.pad(), aux_weights(state))
    import moa.modeling_moa_fairseq as modeling

    model = getattr(modeling, KINDS[kind][1])(config)
    ours = model.state_dict()
    loaded = {k: v for k, v in weights.items() if k in ours}
    ignored = {k for k in weights if k.endswith((".version", "._float_tensor"))}
    unused = sorted(set(weights) - set(ours) - ignored)
    missing = sorted(set(ours) - set(loaded) - set(model.all_tied_weights_keys))
    if unused or missing:
        raise ToolError(f"{checkpoint}: weights that do not map onto the exported model (unused {unused[:5]}, "
                        f"missing {missing[:5]})")
    model.load_state_dict(loaded, strict=False)
    model.tie_weights()
    if kind == "translation model":
        model.generation_config.update(**GENERATION)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    work = tempfile.mkdtemp(prefix=".moa-export-", dir=parent)
    try:
        model.save_pretrained(work, safe_serialization=True)
        if getattr(model, "generation_config", None) is not None:  # a masked LM generates nothing
            model.generation_config.save_pretrained(work)
        if sentencepiece_model is None:
            word_tokenizer(dictionary, kind == "masked LM").save_pretrained(work)
        else:
            sentencepiece_tokenizer(dictionary, path, sentencepiece_model, kind == "masked LM").save_pretrained(work)
            shutil.copyfile(os.path.join(MOA, "tokenization_moa_fairseq.py"), os.path.join(work, "tokenization_moa_fairseq.py"))
        for name in CODE_FILES:
            shutil.copyfile(os.path.join(MOA, name), os.path.join(work, name))
        with open(os.path.join(work, "config.json"), encoding="utf-8") as f:
            written = json.load(f)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return {"kind": kind, "family": family, "auto": KINDS[kind][2], "model_type": written["model_type"],
            "files": sorted(os.listdir(out_dir))}
