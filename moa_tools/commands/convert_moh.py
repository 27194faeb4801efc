"""``moa-convert-moh``: turn a trained fairseq Transformer, Transformer LM or RoBERTa into MoH (MoH paper, Sec. 4).

    moa-convert-moh CHECKPOINT --shared-heads H_S --top-k K --router {query-norm,learned} --out FILE

Every attention module keeps its weights and becomes MoH over its own heads: the first H_S always
active, top-K of the rest routed per token. ``query-norm`` is the paper's parameter-free router for
converted models (a head's score is the L2 norm of its query; gates of 1, a straight-through
gradient); ``learned`` adds the two-stage router, zero-initialised under the unit gate scale so
that every active head starts with a gate of 1. With K = heads - H_S the converted model computes
what the original did. The checkpoint is read with the safe loader, checked by building and loading
the MoH model, and written to a temporary name renamed into place; on any error nothing is written.

fairseq-generate and fairseq-validate use FILE as it is (``--path FILE --user-dir moa``). To continue
training, pass the printed model flags to fairseq-train with ``--finetune-from-model FILE``.
"""

import argparse
import os
import sys

from moa_tools import USER_DIR, ToolError, run_tool
from moa_tools.moh_conversion import ROUTERS, continue_flags, convert


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-convert-moh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a fairseq-train checkpoint of a transformer, transformer_lm or roberta arch")
    parser.add_argument("--shared-heads", type=int, required=True, metavar="H_S", help="heads always active")
    parser.add_argument("--top-k", type=int, required=True, metavar="K", help="routed heads per token, of the rest")
    parser.add_argument("--router", choices=ROUTERS, required=True)
    parser.add_argument("--out", required=True, help="the MoH checkpoint to write")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.checkpoint):
        raise ToolError(f"no such checkpoint: {args.checkpoint}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ToolError(f"the folder of --out does not exist: {out_dir}")
    from moa_tools.checkpoints import load_checkpoint, save_atomically

    state, summary = convert(load_checkpoint(args.checkpoint), args.shared_heads, args.top_k, args.router,
                             args.checkpoint)
    save_atomically(state, args.out)
    print(f"wrote {args.out}: {summary}")
    print(f"continue training with: fairseq-train DATA --user-dir {USER_DIR} " + " ".join(continue_flags(state))
          + f" --finetune-from-model {args.out}")
    return 0


def main(argv=None) -> int:
    return run_tool("moa-convert-moh", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
