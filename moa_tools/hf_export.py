"""Export a fairseq checkpoint of the plugin to a Hugging Face model folder (``moa-export-hf``).

The folder holds what ``AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)`` need, and nothing that imports fairseq or moa: ``config.json``
(with ``auto_map``), ``model.safetensors``, ``generation_config.json``, the tokenizer's files (token ids are
fairseq's dictionary ids) and the modelling code, :mod:`moa.modeling_moa_fairseq` with the torch-only
attention layers it imports (and, for sentencepiece data, :mod:`moa.tokenization_moa_fairseq`). Language
models are exported (``transformer_lm``, ``moa_lm``, ``moh_lm``, ``switchhead_lm`` and their archs).
"""

import argparse
import json
import os
import shutil
import tempfile

from moa_tools import ToolError

MOA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moa")
# the modelling code and the torch-only layers it imports, copied beside the weights
CODE_FILES = ("configuration_moa_fairseq.py", "modeling_moa_fairseq.py", "moa_attention.py", "moh_attention.py",
              "switchhead_attention.py", "routed_attention.py", "incremental_state.py", "routing.py", "dispatch.py",
              "experts.py")
LANGUAGE_MODELS = {"transformer_lm": "transformer", "moa_lm": "moa", "moh_lm": "moh", "switchhead_lm": "switchhead"}
AUTO_MAP = {"AutoConfig": "configuration_moa_fairseq.MoaFairseqConfig",
            "AutoModelForCausalLM": "modeling_moa_fairseq.MoaFairseqForCausalLM"}


def model_family(args) -> str:
    """The family (``transformer``, ``moa``, ``moh``, ``switchhead``) of a language-model checkpoint's
    arguments, or a ToolError naming what is not exported."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch)
    if model not in LANGUAGE_MODELS:
        raise ToolError(f"the checkpoint's arch {arch!r} (model {model!r}) is not exported: moa-export-hf exports "
                        f"the language models ({', '.join(sorted(LANGUAGE_MODELS))} and their archs)")
    return LANGUAGE_MODELS[model]


def attention_arguments(args, family: str) -> list:
    """Each layer's routed attention constructor arguments, read off the fairseq model the arguments build."""
    if family == "transformer":
        return [{} for _ in range(args.decoder_layers)]
    from moa.routed_attention import RoutedAttention

    model = build_model(args)
    modules = [layer.self_attn for layer in model.decoder.layers]
    assert all(isinstance(m, RoutedAttention) for m in modules)
    return [constructor_arguments(m) for m in modules]


def constructor_arguments(module) -> dict:
    """The arguments that rebuild a routed self-attention module of the plugin (its weights aside)."""
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


def build_model(args):
    """The fairseq model of ``args`` (a checkpoint's model arguments) on a dictionary of its size."""
    import copy

    from moa.models.build import build_from_args, dictionary_of_size

    args = copy.deepcopy(args)
    return build_from_args(args, dictionary_of_size(args.vocab_size_for_export))


def hf_config(args, family: str, vocab_size: int):
    """The :class:`~moa.configuration_moa_fairseq.MoaFairseqConfig` of a language-model checkpoint."""
    from moa.configuration_moa_fairseq import MoaFairseqConfig

    if getattr(args, "adaptive_input", False) or getattr(args, "adaptive_softmax_cutoff", None) or \
            getattr(args, "character_embeddings", False):
        raise ToolError("adaptive inputs, adaptive softmax and character embeddings are not exported")
    if getattr(args, "decoder_output_dim", args.decoder_embed_dim) != args.decoder_embed_dim or \
            getattr(args, "decoder_input_dim", args.decoder_embed_dim) != args.decoder_embed_dim:
        raise ToolError("a decoder whose input or output width differs from its embedding width is not exported")
    args.vocab_size_for_export = vocab_size
    layers = attention_arguments(args, family)
    same = all(layer == layers[0] for layer in layers)
    normalize_before = bool(args.decoder_normalize_before)
    return MoaFairseqConfig(
        vocab_size=vocab_size, embed_dim=args.decoder_embed_dim, ffn_dim=args.decoder_ffn_embed_dim,
        layers=args.decoder_layers, attention_heads=args.decoder_attention_heads, family=family,
        attention=layers[0] if same else {}, attention_per_layer=None if same else layers,
        activation_fn=getattr(args, "activation_fn", "relu"), dropout=args.dropout,
        attention_dropout=args.attention_dropout, activation_dropout=getattr(args, "activation_dropout", 0.0),
        normalize_before=normalize_before,
        final_layer_norm=normalize_before and not getattr(args, "no_decoder_final_norm", False),
        layernorm_embedding=bool(getattr(args, "layernorm_embedding", False)),
        scale_embedding=not getattr(args, "no_scale_embedding", False),
        learned_positions=bool(getattr(args, "decoder_learned_pos", False)),
        token_positions=not getattr(args, "no_token_positional_embeddings", False),
        max_positions=args.tokens_per_sample if getattr(args, "max_target_positions", None) is None
        else args.max_target_positions,
        tie_word_embeddings=bool(args.share_decoder_input_output_embed), auto_map=AUTO_MAP,
        architectures=["MoaFairseqForCausalLM"])


def word_tokenizer(dictionary_file: str):
    """A ``PreTrainedTokenizerFast`` of a fairseq dictionary: whitespace-separated symbols to their ids,
    ``</s>`` after each line (as fairseq binarises a line), ``<unk>`` for symbols not in it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from fairseq.data import Dictionary

    dictionary = Dictionary.load(dictionary_file)
    vocab = {symbol: i for i, symbol in enumerate(dictionary.symbols)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=dictionary.unk_word))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {dictionary.eos_word}", special_tokens=[(dictionary.eos_word, dictionary.eos())])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=dictionary.bos_word,
                                   eos_token=dictionary.eos_word, unk_token=dictionary.unk_word,
                                   pad_token=dictionary.pad_word)


def sentencepiece_tokenizer(dictionary_file: str, sentencepiece_model: str):
    """The exported :class:`~moa.tokenization_moa_fairseq.FairseqSentencePieceTokenizer` (raw text in), its
    symbols checked against fairseq's reading of the dictionary, id for id."""
    from fairseq.data import Dictionary

    from moa.tokenization_moa_fairseq import FairseqSentencePieceTokenizer

    tokenizer = FairseqSentencePieceTokenizer(dictionary_file, sentencepiece_model)
    if tokenizer.symbols != Dictionary.load(dictionary_file).symbols:
        raise ToolError(f"{dictionary_file} reads differently in fairseq and in the exported tokenizer")
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["tokenization_moa_fairseq.FairseqSentencePieceTokenizer", None]}
    return tokenizer


def export(checkpoint: str, data_bin: str, out_dir: str, sentencepiece_model: str = None) -> dict:
    """Write the Hugging Face folder of ``checkpoint`` (its dictionary: ``data_bin``/dict.txt; its data's
    ``sentencepiece_model``, if any) to ``out_dir``, through a temporary folder moved into place at the end;
    returns what was written."""
    if sentencepiece_model is not None and not os.path.isfile(sentencepiece_model):
        raise ToolError(f"no such sentencepiece model: {sentencepiece_model} (the recipes write it as "
                        "DATA/spm/spm.model)")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ToolError(f"{out_dir} exists and is not empty: name a new folder (nothing is overwritten)")
    dictionary_file = os.path.join(data_bin, "dict.txt")
    if not os.path.isfile(dictionary_file):
        raise ToolError(f"{data_bin} has no dict.txt: give the data-bin the model was trained on")
    from moa_tools.checkpoints import load_checkpoint

    state = load_checkpoint(checkpoint)
    args = state.get("args") or (state.get("cfg") or {}).get("model")
    if args is None:
        raise ToolError(f"{checkpoint} records no model arguments: it was not written by fairseq-train")
    if isinstance(args, dict):  # a dataclass model's config (fairseq's transformer_lm): its arch is _name
        args = argparse.Namespace(**args)
        args.arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    family = model_family(args)
    weights = state["model"]
    rows = weights["decoder.embed_tokens.weight"].shape[0]
    from fairseq.data import Dictionary

    size = len(Dictionary.load(dictionary_file))
    if size != rows:
        raise ToolError(f"{dictionary_file} has {size} symbols but the checkpoint's embeddings have {rows} rows: give "
                        "the data-bin the model was trained on")
    config = hf_config(args, family, rows)
    from moa.modeling_moa_fairseq import MoaFairseqForCausalLM

    model = MoaFairseqForCausalLM(config)
    ours = model.state_dict()
    loaded = {k: v for k, v in weights.items() if k in ours}
    unused = sorted(set(weights) - set(ours) - {"decoder.version", "decoder.embed_positions._float_tensor"})
    missing = sorted(set(ours) - set(loaded) - ({"decoder.output_projection.weight"} if config.tie_word_embeddings
                                                else set()))
    if unused or missing:
        raise ToolError(f"{checkpoint}: weights that do not map onto the exported model (unused {unused[:5]}, "
                        f"missing {missing[:5]})")
    model.load_state_dict(loaded, strict=False)
    model.tie_weights()
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    work = tempfile.mkdtemp(prefix=".moa-export-", dir=parent)
    try:
        model.save_pretrained(work, safe_serialization=True)
        model.generation_config.save_pretrained(work)
        if sentencepiece_model is None:
            word_tokenizer(dictionary_file).save_pretrained(work)
        else:
            sentencepiece_tokenizer(dictionary_file, sentencepiece_model).save_pretrained(work)
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
    return {"family": family, "model_type": written["model_type"], "files": sorted(os.listdir(out_dir))}
