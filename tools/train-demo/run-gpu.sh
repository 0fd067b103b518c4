#!/usr/bin/env bash
# On the GPU machine: train, convert to 4-bit with moeflux, make the
# transformers oracle golden.
#   bash tools/train-demo/run-gpu.sh DATA MOEFLUX OUT [STEPS]
# OUT gets train.json, oracle.json, demo-q4.tar and hf.tar.part-* (the bf16
# checkpoint in parts small enough for the device tool's 16 MiB file limit).
set -euo pipefail
data=$(realpath "$1") moeflux=$(realpath "$2") out=$(realpath "$3") steps=${4:-750}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
cd "$here"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
python3 train.py --data "$data" --out "$work/run" --steps "$steps" --max-seconds 1e9
"$moeflux" convert "$work/run/hf" "$work/demo"
python3 oracle.py --model "$work/demo" --val "$data/val.txt" --out "$out/oracle.json" --device cuda
cp "$work/run/train.json" "$out/"
tar -C "$work" -cf "$out/demo-q4.tar" demo
tar -C "$work/run" -cf - hf | split -b 15M - "$out/hf.tar.part-"
ls -la "$out"
