"""``moa-average-checkpoints``: average the parameters of fairseq checkpoints (safely loaded).

    moa-average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 10 --output averaged.pt
    moa-average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 --output averaged.pt
    moa-average-checkpoints --inputs a.pt b.pt c.pt --output averaged.pt

The output keeps the newest checkpoint's configuration and carries the mean of every model
tensor; it is written to a temporary name and renamed when complete.
"""

import argparse
import os
import sys

from moa_tools import ToolError, run_tool
from moa_tools.checkpoints import average, last_checkpoints, save_atomically


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-average-checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", nargs="+", required=True, help="checkpoint files, or one folder")
    parser.add_argument("--output", required=True)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int)
    group.add_argument("--num-update-checkpoints", type=int)
    parser.add_argument("--checkpoint-upper-bound", type=int, help="ignore checkpoints after this epoch/update")
    args = parser.parse_args(argv)
    count = args.num_epoch_checkpoints or args.num_update_checkpoints
    if count:
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            raise ToolError("--num-*-checkpoints needs --inputs to be one checkpoint folder")
        paths = last_checkpoints(args.inputs[0], count, args.num_update_checkpoints is not None,
                                 args.checkpoint_upper_bound)
    else:
        paths = args.inputs
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ToolError(f"no such checkpoint: {', '.join(missing)}")
    save_atomically(average(paths), args.output)
    print(f"averaged {len(paths)} checkpoints into {args.output}: {', '.join(os.path.basename(p) for p in paths)}")
    return 0


def main(argv=None) -> int:
    return run_tool("moa-average-checkpoints", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
