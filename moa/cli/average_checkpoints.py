"""``moa-average-checkpoints``: average the parameters of fairseq checkpoints (safely loaded).

    moa-average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 10 --output averaged.pt
    moa-average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 --output averaged.pt
    moa-average-checkpoints --inputs a.pt b.pt c.pt --output averaged.pt

The fairseq package ships no ``average_checkpoints.py``; this is the same
operation with torch's weights-only loader (the plugin's allow-list) instead of
unpickling arbitrary code. The output keeps the newest checkpoint's
configuration and carries the mean of every model tensor; it is written to a
temporary name and renamed when complete.
"""

import argparse
import collections
import os
import pickle
import re
import sys

import torch

import moa  # noqa: F401  (registers the safe-loading allow-list)


def last_checkpoints(folder: str, count: int, by_update: bool, upper_bound=None):
    """The ``count`` newest epoch (checkpointN.pt) or update (checkpoint_E_U.pt) checkpoints in ``folder``."""
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(folder):
        match = pattern.fullmatch(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    if len(found) < count:
        kind = "update" if by_update else "epoch"
        raise ValueError(f"{folder} holds {len(found)} {kind} checkpoints, fewer than the {count} asked for")
    return [path for _, path in sorted(found)[-count:]]


def average(paths):
    """The newest checkpoint's state with ``model`` replaced by the mean over ``paths``."""
    total, newest, keys = collections.OrderedDict(), None, None
    for path in paths:
        state = torch.load(path, map_location="cpu")  # weights_only: the safe loader
        model = state["model"]
        if keys is None:
            keys = list(model)
        elif list(model) != keys:
            raise ValueError(f"{path} holds other parameters than {paths[0]}: not checkpoints of one model")
        for name, tensor in model.items():
            value = tensor.double() if tensor.is_floating_point() else tensor
            total[name] = value.clone() if name not in total else total[name] + value
        newest = state
    for name, tensor in total.items():
        reference = newest["model"][name]
        total[name] = (tensor / len(paths)).to(reference.dtype) if reference.is_floating_point() else reference
    newest["model"] = total
    return newest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moa-average-checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", nargs="+", required=True, help="checkpoint files, or one folder")
    parser.add_argument("--output", required=True)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int)
    group.add_argument("--num-update-checkpoints", type=int)
    parser.add_argument("--checkpoint-upper-bound", type=int, help="ignore checkpoints after this epoch/update")
    args = parser.parse_args(argv)
    try:
        count = args.num_epoch_checkpoints or args.num_update_checkpoints
        if count:
            if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
                raise ValueError("--num-*-checkpoints needs --inputs to be one checkpoint folder")
            paths = last_checkpoints(args.inputs[0], count, args.num_update_checkpoints is not None,
                                     args.checkpoint_upper_bound)
        else:
            paths = args.inputs
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"no such checkpoint: {', '.join(missing)}")
        state = average(paths)
    except (ValueError, KeyError, OSError, pickle.UnpicklingError) as e:  # unsafe pickles: UnpicklingError
        print(f"moa-average-checkpoints: error: {e}", file=sys.stderr)
        return 1
    tmp = args.output + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, args.output)
    print(f"averaged {len(paths)} checkpoints into {args.output}: {', '.join(os.path.basename(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
