#!/usr/bin/env bash
# What one device call runs (H200): `bash scripts/gpu_run.sh OUT_DIR STAGE...`.
# Stages: tests (metrics + lockstep gpu tests), fused (Triton kernel gpu tests), full (Wan2.2 full pair test), sharded (2-GPU FSDP2 tests),
# bench (bench/full_pair.py), drift (bench/gpu_drift.py: reduced trajectories, seeded trained-like
# weights), parity (dtype flow, bitwise parity, scenarios and FSDP2 gpu tests). Each stage logs to OUT_DIR and a failing stage does not stop the
# next one. Expects torch with CUDA installed and the other wheels on PYTHONPATH.
set -uo pipefail
out="$1"
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpu_pytest() { python -m pytest -m gpu -o addopts="" -q -rs "$@"; }
for stage in "$@"; do
    start=$(date +%s)
    case "$stage" in
    tests)
        gpu_pytest tests/test_metrics_gpu.py tests/test_lockstep.py >"$out/gpu_tests.log" 2>&1
        ;;
    fused) gpu_pytest tests/test_fused_stats.py >"$out/fused_gpu.log" 2>&1 ;;
    full) gpu_pytest -s tests/test_full_gpu.py >"$out/full_gpu.log" 2>&1 ;;
    sharded) gpu_pytest -s tests/test_fsdp2_sharded_gpu.py >"$out/sharded_gpu.log" 2>&1 ;;
    bench) python bench/full_pair.py "$out/bench" >"$out/full_pair.log" 2>&1 ;;
    drift) python bench/gpu_drift.py "$out/drift.json" >"$out/drift.log" 2>&1 ;;
    parity)
        gpu_pytest tests/test_dtype_flow.py tests/test_parity_gpu.py \
            tests/test_fsdp2_gpu.py >"$out/parity_gpu.log" 2>&1
        ;;
    *) echo "unknown stage $stage" >&2 && false ;;
    esac
    rc=$?
    echo "stage $stage: rc $rc, $(($(date +%s) - start)) s" | tee -a "$out/stages.log"
done
