#!/usr/bin/env bash
# One device check (issue 37, item 16): every figure the docs say needs a
# device, in at most 8 minutes on one GPU, ending with one summary line per
# figure -- training tokens/s and MFU at small and 350M (bf16), split lockstep
# and pipelined on the device, the link from the GPU, 8 LoRA tenants' memory.
# Each figure is its bench script's own (called here, bounded by `timeout`).
#
#   bench/device_check.sh                     # on a GPU box
#   bench/device_check.sh --cpu               # the plumbing at tiny sizes
#   bench/device_check.sh --cpu --only split,link
#
# Without a CUDA device it says it skipped the device and runs the --cpu mode.
# Exit status: 0 when every figure printed its line, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
mode=gpu
only=train,split,link,tenants
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) mode=cpu ;;
        --only) only=${2:?--only needs a list, e.g. split,link}; shift ;;
        *) echo "device_check: error: unknown argument $1 (--cpu, --only LIST)" >&2; exit 2 ;;
    esac
    shift
done
py=${PYTHON:-python}
if [ "$mode" = gpu ] && ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "device_check: no CUDA device here: skipped the device; the plumbing at tiny sizes (--cpu)"
    mode=cpu
fi
logs=$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")
summary=()
failed=0

# figure NAME SECONDS PATTERN COMMAND...: run the bench, keep its summary lines
figure() {
    local name=$1 limit=$2 pattern=$3
    shift 3
    case ",$only," in *",$name,"*) ;; *) return 0 ;; esac
    echo "device_check: $name: $* (at most ${limit} s)"
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$? lines
    lines=$(grep -E "$pattern" "$logs/$name.log" | sed -e 's/^ *//' -e 's/  */ /g')
    if [ $rc -ne 0 ] || [ -z "$lines" ]; then
        tail -n 5 "$logs/$name.log" >&2
        summary+=("$name: FAILED (exit $rc, log $logs/$name.log)")
        failed=1
        return 0
    fi
    while IFS= read -r line; do summary+=("$name: $line"); done <<<"$lines"
}

if [ "$mode" = gpu ]; then
    # 150 + 90 + 90 + 150 s: the whole check within 8 minutes
    figure train 150 '^train .* on ' "$py" bench/train_throughput.py \
        --configs small 350M --rounds 1 --steps 20 --warmup 3 --device cuda
    figure split 90 'of paired baseline' "$py" bench/split_efficiency.py \
        --model small --sections in-process --quick --device cuda
    figure link 90 '^gpu: ' "$py" bench/link_gpu.py --device cuda
    figure tenants 150 '^memory with ' "$py" bench/tenants.py \
        --quick --device cuda --tenants 1,8
else
    figure train 120 '^train .* on ' "$py" bench/train_throughput.py \
        --configs tiny --rounds 1 --steps 2 --warmup 1 --batch-size 2 --device cpu
    figure split 120 'of paired baseline' "$py" bench/split_efficiency.py \
        --model tiny --sections in-process --steps 2 --warmup 1 --batch-size 2 \
        --device cpu
    figure link 120 '^gpu: ' "$py" bench/link_gpu.py \
        --device cpu --shape 2,64,64 --n 4 --rounds 1
    figure tenants 300 '^memory with ' "$py" bench/tenants.py \
        --tiny --tenants 1,2 --steps 2
fi

echo "device_check: $mode, logs in $logs"
for line in "${summary[@]}"; do echo "$line"; done
exit $failed
