#!/usr/bin/env bash
# The GPU checks of benchmarks/README.md section "On a GPU", stage by stage, on a CUDA machine with PyTorch installed.
#
#   bash benchmarks/gpu_checks.sh RESULTS_DIR STAGE [STAGE ...]
#
# Stages: env, constants, debug, plan, gpu_bench, var_official, measure, fsdp (see each below). Every stage runs
# under its own time limit, writes its JSON result and log into RESULTS_DIR, and a failing stage does not stop the
# others. Run from the repository root; `pip install -e .` first, or run with the checkout on PYTHONPATH.
# Settings (environment): STAGE_SECONDS (a stage's limit, 540), WORK (weights and runs), RESULTS_TGZ (also pack the
# results there after each stage); debug: DEBUG_RECIPES, DEBUG_PRECISIONS, DEBUG_COMPILE, DEBUG_JOBS, DEBUG_TAG;
# constants: CONSTANT_STEPS (comma list of bench_gpu_constants.py's steps; default all);
# plan: PLAN_CASES, PLAN_ROWS (usual,largest,next), PLAN_FLAGS (more flags, e.g. "--deterministic true"), PREDICTED
# (comma list; default every results/plan_gpu_predicted_H100-80GB_*.json);
# measure: MEASURE_CASES (var_d16,moco_vit_s,moco_r50), GPU_PROFILE (the planner's profile of this GPU, H100-80GB),
# MEASURE_STEPS (timed steps, 20);
# gpu_bench: GPU_BENCH_ARGS (e.g. "--section precision"); var_official: VAR_SECONDS, VAR_IMAGES, VAR_REPEATS,
# VAR_VARIANTS, VAR_PRECISIONS (bf16-amp,fp16-amp-scale).
set -u
results=$(realpath -m "$1")
shift
mkdir -p "$results"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
work=${WORK:-/tmp/trainlab-gpu-checks}
mkdir -p "$work"
limit=${STAGE_SECONDS:-540}

tokenizer() {  # the ch=160 VQVAE of the official architecture (random init) the VAR stages need, written once
    $py -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_var import write_tokenizer; print(write_tokenizer(Path('$work/plan'), 'ch160')[0])"
}

stage() {  # stage NAME SECONDS COMMAND...: run, log, and never stop the script
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" >"$results/$name.log" 2>&1
    local rc=$?
    echo "=== $name exit $rc after $((SECONDS - t0)) s"
    tail -n 25 "$results/$name.log"
}

for s in "$@"; do
    case $s in
    env)  # the machine and the software: what every figure below was measured with
        stage env 60 bash -c "nvidia-smi; $py -c 'import torch, torchvision, timm; print(torch.__version__, torch.version.cuda, torchvision.__version__, timm.__version__, torch.cuda.get_device_name(0), torch.backends.cudnn.version())'; $py -m trainlab doctor"
        ;;
    constants)  # the CUDA context, cuBLAS / cuDNN workspaces, SDPA backends, NCCL buffers on this GPU
        stage constants 240 "$py" benchmarks/bench_gpu_constants.py --json "$results/constants.json" \
            ${CONSTANT_STEPS:+--steps "$CONSTANT_STEPS"}
        ;;
    debug)  # every recipe's --debug on cuda in every precision mode
        stage debug "$limit" "$py" benchmarks/bench_gpu_debug.py --jobs "${DEBUG_JOBS:-6}" --work-dir "$work/debug" \
            --recipes "${DEBUG_RECIPES:-cifar,judge,linear-probe,moco,tokenizer,toy,var}" \
            --precisions "${DEBUG_PRECISIONS:-fp32,bf16-amp,fp16-amp-scale,bf16}" \
            --compile-recipes "${DEBUG_COMPILE:-toy,cifar,var}" --json "$results/debug${DEBUG_TAG:-}.json"
        ;;
    plan)  # the planner's predictions (benchmarks/results/plan_gpu_predicted_*.json) against the real peaks
        # every stored prediction, in name order (a later file's case replaces an earlier one's)
        predicted=${PREDICTED:-$(ls benchmarks/results/plan_gpu_predicted_H100-80GB_*.json | paste -sd, -)}
        stage plan "$limit" "$py" benchmarks/bench_plan_gpu.py measure --predicted "$predicted" \
            --cases "${PLAN_CASES:-var_d16,moco_vit_s,moco_r50,cifar_r18}" --rows "${PLAN_ROWS:-usual,largest,next}" \
            --flags="${PLAN_FLAGS:-}" \
            --work-dir "$work/plan" \
            --json "$results/plan.json"
        ;;
    gpu_bench)  # VAR-d16 train and sample images/s, the precision lab on ResNet-18
        stage gpu_bench "$limit" "$py" benchmarks/bench_gpu.py --work-dir "$work/gpu_bench" --json "$results/gpu_bench.json" \
            ${GPU_BENCH_ARGS:-}
        ;;
    var_official)  # VAR-d16's step against the official algorithm, bf16 and fp16 autocast, same GPU and batch
        for p in $(echo "${VAR_PRECISIONS:-bf16-amp,fp16-amp-scale}" | tr , ' '); do
            stage "var_official_$p" "${VAR_SECONDS:-280}" "$py" benchmarks/bench_var.py --device cuda --precision "$p" \
                --case train_d16 --tokenizer ch160 --batch-size 64 --train-images "${VAR_IMAGES:-640}" \
                --repeats "${VAR_REPEATS:-2}" --variants "${VAR_VARIANTS:-official,command,cached,compiled}" \
                --threads 8 --work-dir "$work/var" --json "$results/var_official_$p.json"
        done
        ;;
    measure)  # trainlab plan --measure: the measured efficiency (MFU) per recipe family on this GPU
        gpu=${GPU_PROFILE:-H100-80GB}
        steps=${MEASURE_STEPS:-20}
        for c in $(echo "${MEASURE_CASES:-var_d16,moco_vit_s,moco_r50}" | tr , ' '); do
            case $c in
            var_d16)
                flags="var --config var_d16 --batch-size 96 --data.fake-size 4096 --tokenizer-weights $(tokenizer)" ;;
            moco_vit_s) flags="moco --config moco_v3_vit_small --batch-size 128 --data.fake-size 512" ;;
            moco_r50) flags="moco --config moco_v3_r50_100ep --batch-size 128 --data.fake-size 512" ;;
            *) echo "unknown measure case $c"; continue ;;
            esac
            stage "measure_$c" "$limit" "$py" -m trainlab plan $flags --grad-accumulation 1 --data.kind fake \
                --gpu "$gpu" --measure --steps "$steps" --json
        done
        ;;
    fsdp)  # VAR-d16 --fsdp on one GPU through trainlab launch (the code path); its peaks in the run's summary row
        # (the plan to compare with: `trainlab plan var` with the same flags and --gpus 1 --gpu H100-80GB --json)
        tokenizer
        stage fsdp "$limit" bash -c "
            $py -m trainlab launch --nproc-per-node 1 train var --config var_d16 --batch-size 96 --grad-accumulation 1 \
                --fsdp true --data.kind fake --data.fake-size 960 --max-steps 3 --tokenizer-weights \
                $work/plan/tokenizer_ch160.pth --run-dir $work/fsdp_run --overwrite true --progress false \
                --num-workers 8 && grep summary $work/fsdp_run/metrics.jsonl"
        ;;
    *)
        echo "unknown stage $s"
        ;;
    esac
    tar czf "${RESULTS_TGZ:-$results.tgz}" -C "$results" . 2>/dev/null
done
