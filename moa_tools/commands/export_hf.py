"""``moa-export-hf``: a trained model of the plugin as a Hugging Face ``transformers`` model folder.

    moa-export-hf CHECKPOINT DATA_BIN OUT_DIR [--sentencepiece-model SPM]

OUT_DIR gets ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer (fairseq's
dictionary ids; with --sentencepiece-model, the data's sentencepiece model too, so that raw text encodes
as the recipes encode it) and the modelling code, registered through ``auto_map``. It loads with torch,
transformers and sentencepiece alone (``trust_remote_code`` runs the Python files in OUT_DIR):
``AutoModelForCausalLM`` (language models), ``AutoModelForSeq2SeqLM`` (translation models on a joined
dictionary; ``generate`` is fairseq-generate's beam search) or ``AutoModelForMaskedLM`` (RoBERTa)
``.from_pretrained(OUT_DIR, trust_remote_code=True)``, and ``AutoTokenizer.from_pretrained(OUT_DIR,
trust_remote_code=True)``. Dense, MoA, MoH and SwitchHead models are exported, and moa-convert-moh's output.
The checkpoint is read with the safe loader; OUT_DIR must be new or empty, and is written through a
temporary folder moved into place, so a failed export leaves nothing. Guide: docs/hugging-face.md.
"""

import argparse
import os
import sys

from moa_tools import ToolError, run_tool


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-export-hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a fairseq-train checkpoint (language model, translation model or masked LM)")
    parser.add_argument("data_bin", help="the data-bin the model was trained on (its dict.txt, or dict.SRC.txt for translation)")
    parser.add_argument("out_dir", help="the folder to write (new or empty)")
    parser.add_argument("--sentencepiece-model", metavar="SPM",
                        help="the sentencepiece model the data was encoded with (the recipes': DATA/spm/spm.model); "
                             "without it the tokenizer takes whitespace-separated dictionary symbols")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.checkpoint):
        raise ToolError(f"no such checkpoint: {args.checkpoint}")
    if not os.path.isdir(args.data_bin):
        raise ToolError(f"no such data-bin folder: {args.data_bin}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ToolError("transformers is not installed: pip install transformers safetensors") from None
    from moa_tools.hf_export import export

    written = export(args.checkpoint, args.data_bin, args.out_dir, args.sentencepiece_model)
    print(f"{args.out_dir}: {written['family']} {written['kind']}, {', '.join(written['files'])}")
    print(f"load: {written['auto']}.from_pretrained({args.out_dir!r}, trust_remote_code=True)")
    return 0


def main(argv=None) -> int:
    return run_tool("moa-export-hf", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
