#!/usr/bin/env bash
# The GPU paths that can run where TensorFlow is not installed (the lent device machines hold
# torch, not TensorFlow): the byo MLP's DDP plugin with its replicas on a CUDA GPU, through the
# torchrun launcher (parity_tests.launch.torch), against the same plugin on the CPU. Writes
# $OUT/{gpu_gloo4,gpu_nccl1,cpu_gloo4}.npz and their manifests; compare them where tfpar is
# installed: tfpar compare examples/byo/mlp/case.json --impls recorded:cpu_gloo4.npz,recorded:gpu_gloo4.npz
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
case=examples/byo/mlp/case.json
python3 - <<'PY'
import json, os
c = json.load(open("examples/byo/mlp/case.json")); c["parallel"]["devices"] = 1; c["name"] += "-1dev"
json.dump(c, open(os.environ.get("OUT", "/tmp/gpu-check") + "/case1.json", "w"))
PY
run() { local n=$1 backend=$2 impl=$3 out=$4 c=$5; local t0=$SECONDS
  torchrun --standalone --nproc_per_node "$n" -m parity_tests.launch.torch "$c" --impl "$impl" --backend "$backend" \
    --out "$OUT/$out.npz" 2>&1 | grep -v "^W1\|^\*\*\*\|OMP_NUM_THREADS\|^$" | tail -4
  echo "$out: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"; }
run 4 gloo benchmarks/gpu/torch_ddp_cuda.py:ddp gpu_gloo4 "$case"
run 1 nccl benchmarks/gpu/torch_ddp_cuda.py:ddp gpu_nccl1 "$OUT/case1.json"
run 4 gloo examples/byo/mlp/torch_ddp.py:ddp cpu_gloo4 "$case"
ls "$OUT"
