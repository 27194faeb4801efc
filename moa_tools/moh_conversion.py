"""Turning a trained fairseq ``transformer``, ``transformer_lm`` or ``roberta`` checkpoint into MoH
(MoH paper, Sec. 4; a language model is the paper's own case, MoH-LLaMA3).

Every attention module of the model becomes :class:`~moa.moh_attention.MixtureOfHeadsAttention`
over its own heads: the first ``shared_heads`` always active (as the paper converts LLaMA3) and
``top_k`` of the others routed per token. MoH keeps fairseq's attention parameter names, so every
weight is copied as it is; what the conversion adds is the router:

* ``query-norm``: the paper's parameter-free router (:class:`~moa.routing.QueryNormHeadRouter`),
  nothing to add;
* ``learned``: the two-stage router with every weight zero and the released code's ``unit`` gate
  scale, under which uniform routers give every active head a gate of exactly 1: the converted
  model is multi-head attention over the active heads, and equals the original when every head
  is active. (With K = 1 the unit scale makes a routed gate p_i / p_i = 1 whatever W_r, so W_r
  then learns from L_b only; W_s and W_h learn from the task loss.)

With every head active (``top_k`` = heads - ``shared_heads``) both give the original model's
outputs. torch and fairseq are imported when a function runs, not with this module.
"""

import argparse
import copy

from moa_tools import ToolError

#: fairseq model -> (MoH arch that continues it, its attention types)
SOURCES = {"transformer": ("moh_transformer", ("encoder-self", "decoder-self", "decoder-cross")),
           "transformer_lm": ("moh_lm", ("decoder-self",)),
           "roberta": ("moh_roberta", ("encoder-self",))}
ROUTERS = ("query-norm", "learned")


def model_args(state: dict, path: str) -> argparse.Namespace:
    """The model's argparse namespace in a fairseq checkpoint (``cfg.model``, or ``args`` of old ones);
    a model with a dataclass config (``transformer_lm``) stores a dict, named by its ``_name``."""
    cfg = state.get("cfg")
    args = cfg.get("model") if isinstance(cfg, dict) else None
    if isinstance(args, dict) and args.get("_name"):
        args = argparse.Namespace(**{k: v for k, v in args.items() if k != "_name"}, arch=args["_name"])
    args = args if isinstance(args, argparse.Namespace) else state.get("args")
    if not isinstance(args, argparse.Namespace) or not getattr(args, "arch", None):
        raise ToolError(f"{path} names no fairseq model arch (no cfg.model or args): it was not written by "
                        "fairseq-train")
    return args


def source_model(args: argparse.Namespace, path: str) -> str:
    """'transformer' or 'roberta': the fairseq model behind the checkpoint's arch."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    import moa  # noqa: F401  (registers the MoA and MoH archs, so that their checkpoints are named)

    model = ARCH_MODEL_NAME_REGISTRY.get(args.arch, getattr(args, "_name", None) or args.arch)
    if model not in SOURCES:
        already = " (it is routed already)" if model.startswith(("moa_", "moh_")) else ""
        raise ToolError(f"{path} holds a {model!r} model (arch {args.arch}){already}; moa-convert-moh converts "
                        f"fairseq {' and '.join(repr(m) for m in SOURCES)} checkpoints")
    return model


def attention_shapes(args: argparse.Namespace, model: str) -> dict:
    """attention type -> (d_model of its queries, heads), for the types the model has."""
    if model == "transformer_lm":
        return {"decoder-self": (args.decoder_embed_dim, args.decoder_attention_heads)}
    shapes = {"encoder-self": (args.encoder_embed_dim, args.encoder_attention_heads)}
    if model == "transformer":
        shapes["decoder-self"] = (args.decoder_embed_dim, args.decoder_attention_heads)
        if not getattr(args, "no_cross_attention", False):
            shapes["decoder-cross"] = (args.decoder_embed_dim, args.decoder_attention_heads)
    return shapes


def check_heads(shapes: dict, shared_heads: int, top_k: int) -> None:
    from moa.routing import check_head_counts

    for kind, (dim, heads) in shapes.items():
        if dim % heads:
            raise ToolError(f"the {kind} attention has d_model {dim}, which its {heads} heads do not divide; "
                            "MoH needs whole heads")
        try:
            check_head_counts(heads, shared_heads, top_k)
            if not top_k and heads > shared_heads:
                raise ValueError("a converted model is fine-tuned, and K = 0 would leave its routed heads unused")
        except ValueError:
            raise ToolError(f"--shared-heads {shared_heads} --top-k {top_k} do not fit the {heads} heads of {kind} "
                            f"attention: choose 0 <= H_S <= {heads} and 1 <= K <= {heads} - H_S "
                            f"(K = 0 only when every head is shared; a lower K for decoding is "
                            f"fairseq-generate's --model-overrides)") from None


def _embedding_rows(weights: dict, name: str, path: str) -> int:
    if name not in weights:
        raise ToolError(f"{path} holds no {name}: not the weights of a fairseq {name.split('.')[0]}")
    return weights[name].size(0)


def build_converted(new_args: argparse.Namespace, weights: dict, model: str, path: str):
    """The MoH model of ``new_args`` on dictionaries of the checkpoint's sizes."""
    from moa.models.build import build_from_args, dictionary_of_size

    if model == "roberta":
        source = dictionary_of_size(_embedding_rows(weights, "encoder.sentence_encoder.embed_tokens.weight", path))
        target = source
    elif model == "transformer_lm":
        if getattr(new_args, "adaptive_input", False) or getattr(new_args, "character_embeddings", False):
            raise ToolError(f"{path}: a language model with adaptive input or character embeddings has no plain "
                            "embedding table to size its dictionary by; moa-convert-moh converts LMs with "
                            "token embeddings (decoder.embed_tokens)")
        source = target = dictionary_of_size(_embedding_rows(weights, "decoder.embed_tokens.weight", path))
    else:
        source = dictionary_of_size(_embedding_rows(weights, "encoder.embed_tokens.weight", path))
        target_rows = _embedding_rows(weights, "decoder.embed_tokens.weight", path)
        target = source if target_rows == len(source) else dictionary_of_size(target_rows)
    try:
        return build_from_args(copy.deepcopy(new_args), source, target)
    except ValueError as e:
        raise ToolError(f"{path}: the MoH model cannot be built from this checkpoint's settings: {e}") from e


def convert(state: dict, shared_heads: int, top_k: int, router: str, path: str = "the checkpoint"):
    """The MoH checkpoint of a fairseq transformer/transformer_lm/roberta checkpoint ``state`` (not modified) and a
    one-line summary. The model is built and loaded strictly before anything is returned."""
    import torch

    if router not in ROUTERS:
        raise ToolError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    args = model_args(state, path)
    model = source_model(args, path)
    shapes = attention_shapes(args, model)
    check_heads(shapes, shared_heads, top_k)
    arch, _ = SOURCES[model]
    new_args = copy.deepcopy(args)
    new_args.arch = new_args._name = arch
    new_args.moh_shared_heads, new_args.moh_top_k, new_args.moh_router = shared_heads, top_k, router
    new_args.moh_gate_scale, new_args.moh_balance_loss = "unit", "paper"
    new_args.moh_attention_types = ",".join(shapes)

    weights = state["model"]
    moh = build_converted(new_args, weights, model, path)
    expected = moh.state_dict()
    missing = [k for k in expected if k not in weights and ".router." not in k]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise ToolError(f"{path}: its weights do not match a {args.arch} of these settings (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}); was it saved by fairseq-train?")
    wrong = [k for k in weights if weights[k].shape != expected[k].shape]
    if wrong:
        raise ToolError(f"{path}: {wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, its settings give "
                        f"{tuple(expected[wrong[0]].shape)}")
    converted = {k: weights[k] if k in weights else torch.zeros_like(expected[k]) for k in expected}
    moh.load_state_dict(converted, strict=True)

    new_state = dict(state, model=converted, last_optimizer_state=None)
    if isinstance(state.get("cfg"), dict) and isinstance(state["cfg"].get("model"), (argparse.Namespace, dict)):
        new_state["cfg"] = dict(state["cfg"], model=new_args)
    else:
        new_state["args"] = new_args
    added = sum(expected[k].numel() for k in expected if k not in weights)
    counts = dict.fromkeys(shapes, 0)
    for name, module in moh.named_modules():
        if type(module).__name__ == "MixtureOfHeadsAttention":
            counts["decoder-cross" if module.encoder_decoder_attention else
                   "decoder-self" if name.startswith("decoder.") else "encoder-self"] += 1
    modules = f"{sum(counts.values())} attention modules ({', '.join(f'{n} {kind}' for kind, n in counts.items())})"
    by_heads = {}
    for kind, (_, h) in shapes.items():
        by_heads.setdefault(h, []).append(kind)
    heads = "; ".join(f"{h} heads{' each' if len(by_heads) == 1 else ' in ' + ', '.join(kinds)}: {shared_heads} "
                      f"shared + top-{top_k} of {h - shared_heads} routed, {(shared_heads + top_k) / h:.0%} active"
                      for h, kinds in by_heads.items())
    summary = f"{args.arch} -> {arch}, {router} router, {modules}; {heads}; {added:,} parameters added"
    return new_state, summary


def continue_flags(new_state: dict) -> list:
    """The fairseq-train model flags that build the converted model (the arch, every shape flag whose
    value differs from the arch's default, and the MoH flags), for ``--finetune-from-model``."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    args = model_args(new_state, "the converted checkpoint")
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[args.arch].add_args(parser)
    options = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    defaults = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[args.arch](defaults)
    flags = ["--arch", args.arch]
    for name, default in vars(defaults).items():
        value = getattr(args, name, default)
        if name.startswith("moh_") or name not in options or value == default or value is None:
            continue
        if isinstance(value, bool):
            flags += [options[name]] if value else []
        else:
            flags += [options[name], str(value)]
    flags += ["--moh-shared-heads", str(args.moh_shared_heads), "--moh-top-k", str(args.moh_top_k),
              "--moh-router", args.moh_router, "--moh-gate-scale", args.moh_gate_scale]
    if args.moh_attention_types != defaults.moh_attention_types:
        flags += ["--moh-attention-types", args.moh_attention_types]
    return flags
