#!/usr/bin/env bash
# What one device call runs: `bash scripts/gpu_run.sh OUT_DIR STAGE...`.
# Test stages: tests (metrics, fingerprint, lockstep and no-sync gpu tests), fused (Triton kernel
# gpu tests), paths (the pairing paths bit for bit at reduced), full (Wan2.2 full pair test),
# sharded (2-GPU FSDP2 tests), parity (dtype flow, bitwise parity, scenarios and FSDP2 gpu tests),
# master (MiniMax H3 full: compact master pairs, trained refused), shards (a rank's rows bitwise
# the whole build at reduced; MiniMax H3 full's rank 1 of 2 on one GPU; the NCCL rank forwards),
# causes (checks + attribution at reduced, figures under OUT_DIR/causes; streamed trajectories at
# reduced; pairing paths), trajfull (Qwen-Image and Wan2.2 full trajectories), twogpu (on two
# GPUs: the 2-GPU tests, MiniMax H3 full paired sharded, notebook 10 on it).
# Bench stages (each writes the JSON record docs/performance.md is generated from): size
# (bench/full_size.py: every family at full; SIZE_FAMILIES, SIZE_ARGS such as --fixed-order),
# traj (bench/full_traj.py: full trajectories against their plain forwards, TRAJ_FAMILIES,
# TRAJ_STEPS, TRAJ_ARGS), bench (bench/full_pair.py), drift (bench/gpu_drift.py: reduced
# trajectories), kernels (bench/metric_kernels.py), mismatch (precision-lab bench-mismatch on
# cuda at MISMATCH_PRESET, default reduced), switch (bench/ab_switch.py: each switch of
# SWITCHES, "LAB_A=1,0;LAB_B=x,y", its values side by side in one process, SWITCH_FAMILIES,
# SWITCH_ARGS).
# Each stage logs to OUT_DIR and a failing stage does not stop the
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
        gpu_pytest tests/test_metrics_gpu.py tests/test_metrics.py tests/test_dump.py tests/test_lockstep.py \
            tests/test_pair_syncs_gpu.py tests/test_docs.py >"$out/gpu_tests.log" 2>&1
        ;;
    fused) gpu_pytest tests/test_fused_stats.py tests/test_multi_pair_stats.py >"$out/fused_gpu.log" 2>&1 ;;
    paths) gpu_pytest -s tests/test_pairing_paths.py >"$out/paths_gpu.log" 2>&1 ;;
    full) gpu_pytest -s tests/test_full_gpu.py >"$out/full_gpu.log" 2>&1 ;;
    sharded) gpu_pytest -s tests/test_fsdp2_sharded_gpu.py >"$out/sharded_gpu.log" 2>&1 ;;
    twogpu)
        # Two GPUs: the sharded and 2-rank FSDP2 gpu tests, MiniMax H3 full paired sharded
        # (bench/full_size.py's sharded row alone), and notebook 10 on it as a user runs it.
        gpu_pytest -s tests/test_fsdp2_sharded_gpu.py tests/test_fsdp2_gpu.py >"$out/twogpu_tests.log" 2>&1
        python bench/full_size.py "$out/sharded" --families "" >"$out/sharded_size.log" 2>&1
        python -m lab.views.notebooks notebooks/10_sharded.ipynb "$out/10_sharded.ipynb" -p preset full \
            -p device cuda -p nproc 2 -p interactive False -p out_dir "$out/nb10" >"$out/nb10.log" 2>&1
        ;;
    bench) python bench/full_pair.py "$out/bench" >"$out/full_pair.log" 2>&1 ;;
    drift) python bench/gpu_drift.py "$out/drift.json" >"$out/drift.log" 2>&1 ;;
    kernels) python bench/metric_kernels.py --out "$out/metric_kernels.json" >"$out/metric_kernels.log" 2>&1 ;;
    mismatch)
        # Every family's default pair, top knob, cheapest prescription and drift at reduced.
        python -m lab.views.cli bench-mismatch --preset "${MISMATCH_PRESET:-reduced}" --device cuda \
            --out "$out/mismatch_gpu.json" >"$out/mismatch.log" 2>&1
        ;;
    parity)
        gpu_pytest tests/test_dtype_flow.py tests/test_parity_gpu.py \
            tests/test_fsdp2_gpu.py >"$out/parity_gpu.log" 2>&1
        ;;
    size)
        python bench/full_size.py "$out/size" --families "${SIZE_FAMILIES:-flux,sd3,sd3:large,cosmos3,qwen_image,ltx2,wan2_2,minimax_h3}" \
            ${SIZE_ARGS:-} >"$out/full_size.log" 2>&1
        ;;
    master) gpu_pytest -s tests/test_compact_master.py >"$out/master_gpu.log" 2>&1 ;;
    shards) gpu_pytest -s tests/test_shards_gpu.py tests/test_fsdp2_gpu.py >"$out/shards_gpu.log" 2>&1 ;;
    causes)
        LAB_GPU_OUT="$out/causes" gpu_pytest -s tests/test_checks_gpu.py tests/test_attribute_gpu.py \
            tests/test_pairing_paths.py tests/test_trajectory.py -k "not full_size" \
            >"$out/causes_gpu.log" 2>&1
        # The device returns few files, two folders deep: the figures travel as one archive.
        tar -czf "$out/causes_figures.tgz" -C "$out" causes && rm -rf "$out/causes"
        ;;
    trajfull)
        gpu_pytest -m "gpu and slow" -s tests/test_trajectory.py -k full_size >"$out/trajfull_gpu.log" 2>&1
        ;;
    traj)
        python bench/full_traj.py "$out/traj" --families "${TRAJ_FAMILIES:-qwen_image,wan2_2}" \
            --steps "${TRAJ_STEPS:-2}" ${TRAJ_ARGS:-} >"$out/full_traj.log" 2>&1
        ;;
    switch)
        IFS=';' read -ra switches <<<"${SWITCHES:-LAB_PAIR_CORE=python,cxx}"
        rc_all=0
        for sw in "${switches[@]}"; do
            name="${sw%%=*}"
            python bench/ab_switch.py "$out/ab_switch_${name#LAB_}.json" --switch "$sw" \
                --families "${SWITCH_FAMILIES:-sd3,cosmos3}" ${SWITCH_ARGS:-} \
                >>"$out/ab_switch.log" 2>&1 || rc_all=1
        done
        (exit $rc_all)
        ;;
    *) echo "unknown stage $stage" >&2 && false ;;
    esac
    rc=$?
    echo "stage $stage: rc $rc, $(($(date +%s) - start)) s" | tee -a "$out/stages.log"
done
