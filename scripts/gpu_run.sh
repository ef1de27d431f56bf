#!/usr/bin/env bash
# What one device call runs (H200): `bash scripts/gpu_run.sh OUT_DIR STAGE...`.
# Stages: tests (metrics, fingerprint, lockstep and no-sync gpu tests), fused (Triton kernel gpu tests), paths (the
# pairing paths bit for bit at reduced), full (Wan2.2 full pair test), sharded (2-GPU FSDP2 tests),
# twogpu (on nvidia-h200-x2: the 2-GPU tests, MiniMax H3 full paired sharded, notebook 10 on it),
# bench (bench/full_pair.py), drift (bench/gpu_drift.py: reduced trajectories, seeded trained-like
# weights), parity (dtype flow, bitwise parity, scenarios and FSDP2 gpu tests), size
# (bench/full_size.py: every family at full; SIZE_FAMILIES, SIZE_ARGS such as --fixed-order; SIZE_WATCH=1
# adds bench/host_watch.py's CPU and GPU clocks, run by run), profile (bench/pair_profile.py: where a full pair's
# host time goes, PROFILE_FAMILIES), master (MiniMax H3 full: compact master pairs, trained
# refused), shards (a rank's rows bitwise the whole build at reduced; MiniMax H3 full's rank 1 of 2
# on one GPU; the NCCL rank forwards), causes (checks + attribution at reduced, figures under OUT_DIR/causes; streamed
# trajectories at reduced; pairing paths), trajfull (Qwen-Image and Wan2.2 full trajectories),
# traj (bench/full_traj.py: full trajectories against their plain forwards, TRAJ_FAMILIES, TRAJ_STEPS,
# TRAJ_ARGS such as --gc-ab),
# host (bench/pair_host.py: a full pair's host time function by function, ablations and each
# case's GPU busy time, HOST_FAMILIES), share (bench/ab_cast_share.py: block casts shared between
# the sides and lead hand-overs against the code before stop 16, interleaved, SHARE_FAMILIES), pin
# (bench/pair_pin.py: the kept side threads pinned to one core or not, interleaved, PIN_FAMILIES),
# replay (bench/pair_replay.py: the pairing path's host time without the forwards, REPLAY_FAMILIES),
# ops (bench/pair_ops.py: the torch ops a pair adds over two plain forwards, every thread, OPS_FAMILIES),
# batch (bench/batch_host.py: one metric batch's host time, part by part), spy (bench/pair_spy.py:
# py-spy's samples of each pair case against plain's, SPY_FAMILIES; needs py-spy on PYTHONPATH's bin/),
# stored (bench/ab_as_stored.py: dense pairs of one layout read where they are against copied first,
# interleaved, STORED_FAMILIES),
# report (bench/ab_report_forwards.py: captured modules reporting from instance forwards against
# forward hooks, interleaved, REPORT_FAMILIES), switch (bench/ab_switch.py: each switch of SWITCHES,
# "LAB_A=1,0;LAB_B=x,y", its values side by side in one process, SWITCH_FAMILIES, SWITCH_ARGS), cores
# (bench/core_probe.py: each CPU's speed at the same Python loop, three passes; name it first and
# last to bracket a call).
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
            tests/test_pair_syncs_gpu.py >"$out/gpu_tests.log" 2>&1
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
    parity)
        gpu_pytest tests/test_dtype_flow.py tests/test_parity_gpu.py \
            tests/test_fsdp2_gpu.py >"$out/parity_gpu.log" 2>&1
        ;;
    size)
        # SIZE_WATCH=1: bench/host_watch.py samples the CPU and GPU clocks beside it.
        watcher=""
        if [ -n "${SIZE_WATCH:-}" ]; then
            # --seconds: it ends by itself even if this script is killed before the kill below.
            python bench/host_watch.py "$out/host_watch.jsonl" --seconds 3000 &
            watcher=$!
        fi
        python bench/full_size.py "$out/size" --families "${SIZE_FAMILIES:-flux,sd3,sd3:large,cosmos3,qwen_image,ltx2,wan2_2,minimax_h3}" \
            ${SIZE_ARGS:-} >"$out/full_size.log" 2>&1
        size_rc=$?
        if [ -n "$watcher" ]; then
            kill "$watcher"
            wait "$watcher" 2>/dev/null
            python bench/host_watch.py --join "$out/size/full_size.json" "$out/host_watch.jsonl" \
                >"$out/host_watch.log" 2>&1
        fi
        (exit $size_rc)
        ;;
    profile)
        python bench/pair_profile.py "$out/profile" --families "${PROFILE_FAMILIES:-flux,sd3}" \
            >"$out/pair_profile.log" 2>&1
        ;;
    master) gpu_pytest -s tests/test_compact_master.py >"$out/master_gpu.log" 2>&1 ;;
    shards) gpu_pytest -s tests/test_shards_gpu.py tests/test_fsdp2_gpu.py >"$out/shards_gpu.log" 2>&1 ;;
    cores) python bench/core_probe.py "$out/cores.jsonl" >>"$out/cores.log" 2>&1 ;;
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
    host)
        python bench/pair_host.py "$out/host" --ablate --gpu-profile --families "${HOST_FAMILIES:-sd3,cosmos3,qwen_image,flux}" \
            >"$out/pair_host.log" 2>&1
        ;;
    share)
        python bench/ab_cast_share.py "$out/ab_cast_share.json" --families "${SHARE_FAMILIES:-sd3,cosmos3,qwen_image}" \
            >"$out/ab_cast_share.log" 2>&1
        ;;
    pin)
        python bench/pair_pin.py "$out/pair_pin.json" --families "${PIN_FAMILIES:-sd3,cosmos3,qwen_image}" \
            >"$out/pair_pin.log" 2>&1
        ;;
    spy)
        python bench/pair_spy.py "$out/spy" --families "${SPY_FAMILIES:-sd3}" ${SPY_ARGS:-} >"$out/pair_spy.log" 2>&1
        ;;
    stored)
        python bench/ab_as_stored.py "$out/ab_as_stored.json" --families "${STORED_FAMILIES:-sd3,cosmos3}" \
            >"$out/ab_as_stored.log" 2>&1
        ;;
    batch) python bench/batch_host.py "$out/batch_host.json" >"$out/batch_host.log" 2>&1 ;;
    ops)
        python bench/pair_ops.py "$out/ops" --families "${OPS_FAMILIES:-sd3,cosmos3}" >"$out/pair_ops.log" 2>&1
        ;;
    replay)
        python bench/pair_replay.py "$out/pair_replay.json" --families "${REPLAY_FAMILIES:-sd3,cosmos3}" \
            >"$out/pair_replay.log" 2>&1
        ;;
    traj)
        python bench/full_traj.py "$out/traj" --families "${TRAJ_FAMILIES:-qwen_image,wan2_2}" \
            --steps "${TRAJ_STEPS:-2}" ${TRAJ_ARGS:-} >"$out/full_traj.log" 2>&1
        ;;
    report)
        python bench/ab_report_forwards.py "$out/ab_report_forwards.json" \
            --families "${REPORT_FAMILIES:-sd3,qwen_image,cosmos3}" >"$out/ab_report_forwards.log" 2>&1
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
