#!/usr/bin/env bash
# Train MoA on WMT14 En-De or En-Fr (prepared by prepare-wmt14.sh) with the paper's hyperparameters, as the
# authors' fairseq command sets them: Adam (0.9, 0.98), eps 1e-9, lr 7e-4, inverse_sqrt with 4,000 warm-up
# updates from 1e-7, label smoothing 0.1, --share-all-embeddings, dropout 0.2 / attention 0.2 / activation 0.1
# (the moa_base and moa_big defaults), alpha 0.01, beta 0.001, up to 100 epochs, and 8,192 tokens per GPU
# with update-freq 32 on one GPU: 262,144 tokens per update. --gpus N divides the update-freq so that every
# GPU count sees the same effective batch (max-tokens x GPUs x update-freq = 262,144). --gpus is per node; with
# --nodes N the script is run once on every node, each with its --node-rank, and launches fairseq-train there with
# torchrun (rendezvous at --master HOST:PORT, node 0's address).
# Every epoch is saved and the last 10 kept, for evaluate.sh's checkpoint averaging.
#
#   examples/translation/train-wmt14.sh --pair en-de|en-fr [--data DIR] [--arch moa_base|moa_big|moh_base] [--gpus N]
#       [--nodes N --node-rank R --master HOST:PORT] [--max-tokens 8192] [--save-dir DIR] [--dry-run] [-- extra fairseq-train arguments, which win]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
me=$(basename "$0")

pair=""
data=""
arch=moa_base
gpus=1
nodes=1
node_rank=0
master=""
max_tokens=8192
save_dir=""
dry_run=0
effective=262144
while [ $# -gt 0 ]; do
    case "$1" in
        --pair) pair=$2; shift 2 ;;
        --data) data=$2; shift 2 ;;
        --arch) arch=$2; shift 2 ;;
        --gpus) gpus=$2; shift 2 ;;
        --nodes) nodes=$2; shift 2 ;;
        --node-rank) node_rank=$2; shift 2 ;;
        --master) master=$2; shift 2 ;;
        --max-tokens) max_tokens=$2; shift 2 ;;
        --save-dir) save_dir=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; break ;;
        *) echo "$me: unknown argument $1 (fairseq-train arguments go after --)" >&2; exit 2 ;;
    esac
done
case "$pair" in en-de|en-fr) ;; *) echo "$me: --pair must be en-de or en-fr" >&2; exit 2 ;; esac
data=${data:-wmt14-$pair}
[ -f "$data/dict.en.txt" ] || data="$data/data-bin"   # the prepare-wmt14.sh folder or its data-bin
if [ ! -f "$data/dict.en.txt" ]; then
    echo "$me: no binarised data at $data (run prepare-wmt14.sh --pair $pair first, or pass --data)" >&2; exit 2
fi
if [ "$nodes" -gt 1 ] && [[ ! "$master" =~ ^[^:]+:[0-9]+$ ]]; then
    echo "$me: --nodes $nodes needs --master HOST:PORT (node 0's address and a free port)" >&2; exit 2
fi
per_update=$((max_tokens * gpus * nodes))
if [ "$gpus" -lt 1 ] || [ "$nodes" -lt 1 ] || [ $((effective % per_update)) -ne 0 ]; then
    echo "$me: --max-tokens $max_tokens x --gpus $gpus x --nodes $nodes does not divide the paper's $effective" \
         "tokens per update; use GPU counts and max-tokens whose product divides it (e.g. 1, 2, 4, 8 GPUs with 8192)" >&2
    exit 2
fi
update_freq=$((effective / per_update))
save_dir=${save_dir:-checkpoints/wmt14-$pair-$arch}

cmd=(fairseq-train "$data" --user-dir "$repo/moa" --task translation --source-lang en --target-lang "${pair#en-}"
     --arch "$arch" --share-all-embeddings
     --criterion moa_label_smoothed_cross_entropy --label-smoothing 0.1 --moa-alpha 0.01 --moa-beta 0.001
     --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-9 --clip-norm 0.0
     --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-7
     --max-tokens "$max_tokens" --update-freq "$update_freq" --max-epoch 100
     --save-dir "$save_dir" --keep-last-epochs 10 --log-format simple --log-interval 100)
if [ "$nodes" -gt 1 ]; then   # one torchrun per node; fairseq takes ranks and world size from it
    cmd=(torchrun --nnodes "$nodes" --nproc-per-node "$gpus" --node-rank "$node_rank" --master-addr "${master%:*}"
         --master-port "${master##*:}" "$(command -v fairseq-train || echo fairseq-train)" "${cmd[@]:1}")
elif [ "$gpus" -gt 1 ]; then
    cmd+=(--distributed-world-size "$gpus")
fi
command -v nvidia-smi >/dev/null 2>&1 && cmd+=(--fp16)
cmd+=("$@")
echo "effective batch: $max_tokens tokens x $((gpus * nodes)) GPU(s) x update-freq $update_freq = $effective tokens per update" >&2
if [ "$dry_run" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
"${cmd[@]}"
