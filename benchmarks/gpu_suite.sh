#!/usr/bin/env bash
# Quilt's GPU suite: one call of the device tool, under 9 minutes, everything under $OUT (docs/gpu.md).
#
#   bash benchmarks/gpu_suite.sh              # on the GPU machine (Python 3.12, torch, triton, transformers, peft)
#   bash benchmarks/gpu_suite.sh --dry-run    # here, on CPU: the same steps on tiny shapes (also QUILT_GPU_SUITE_DRY=1)
#
# Steps (QUILT_GPU_STEPS picks them, default "env pytest kernels trace"), each under its own time limit:
#   env      device, driver, versions                                   -> env.log
#   pytest   pytest -m gpu over tests/kernels and tests/engine          -> pytest.log
#   native   the other tests/kernels tests (float32), natively on CUDA  -> native.log   (not by default)
#   kernels  benchmarks/kernels.py (Llama-3-8B shapes, bf16; the experts of  -> kernels.log, kernels.json
#            Qwen3-30B-A3B: grouped_matmul, expert_lora), 4 parts
#   trace    benchmarks/gpu_trace.py (8B shape, adapters, PEFT, TTFT)   -> trace.log, trace.json
#   quant    benchmarks/quantization.py (8B shape: fp8 weights, fp8 KV,  -> quant.log, quant.json   (not by default:
#            int8 against bf16: memory, decode tok/s, agreement)            QUILT_GPU_STEPS="env quant")
#   w4a16    benchmarks/quantized_checkpoints.py (8B shape: a GPTQ W4A16  -> w4a16.log, w4a16.json   (not by default:
#            g128 checkpoint against bf16, decode tok/s at batch 1/16/64,   QUILT_GPU_STEPS="env w4a16"; QUILT_GPU_W4A16_S,
#            16 adapters; goals >= 2.5x at 1-16, >= 1.3x at 64)             360)
#   fp8ckpt  benchmarks/fp8_checkpoint.py (8B shape: an fp8 weight_block_size -> fp8ckpt.log, fp8ckpt.json (not by
#            [128, 128] checkpoint against bf16, decode tok/s at batch 64,    default: QUILT_GPU_STEPS="env fp8ckpt";
#            16 adapters; goal >= 1.6x)                                       QUILT_GPU_FP8CKPT_S, 420)
#   spec     benchmarks/speculative.py on CUDA (demo model, on vs off)   -> spec.log     (not by default)
#   tp       benchmarks/tensor_parallel.py at tp 1, 2, 4, 8 as the GPUs allow -> tp.log   (not by default:
#            it needs 2+ GPUs to say anything; the dry run runs it on 2 CPU ranks; QUILT_GPU_TP_S, 240)
# and suite.log, the table printed last: at most 8 files, the most the device tool brings back.
# The dry run puts stub packages on PYTHONPATH for what the GPU machine lacks (benchmarks/gpu_bare_env.py),
# runs the kernels in Triton's interpreter (--smoke) and the trace on a tiny model (--tiny, same arguments).
# Limits in seconds: QUILT_GPU_PYTEST_S (125), QUILT_GPU_NATIVE_S (120), QUILT_GPU_KERNELS_S (165),
# QUILT_GPU_TRACE_S (200), QUILT_GPU_QUANT_S (420), env 30 (+ 10 s to merge the kernels' JSON): the default
# steps take at most 530 s, "env quant" 450 s;
# extra gpu_trace.py arguments: QUILT_GPU_TRACE_ARGS (default: a shorter trace that fits the limit).
set -u -o pipefail
cd "$(dirname "$0")/.."

DRY="${QUILT_GPU_SUITE_DRY:-0}"
case "${1:-}" in
  --dry-run | --cpu) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_suite.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp/quilt-gpu-out}"
mkdir -p "$OUT"
STEPS="${QUILT_GPU_STEPS:-env pytest kernels trace}"
PYTEST_S="${QUILT_GPU_PYTEST_S:-125}"
NATIVE_S="${QUILT_GPU_NATIVE_S:-120}"
KERNELS_S="${QUILT_GPU_KERNELS_S:-165}"
TRACE_S="${QUILT_GPU_TRACE_S:-200}"
QUANT_S="${QUILT_GPU_QUANT_S:-420}"
W4A16_S="${QUILT_GPU_W4A16_S:-360}"
QUANT_ARGS="${QUILT_GPU_QUANT_ARGS---layers 16 --rounds 2}"
FP8CKPT_S="${QUILT_GPU_FP8CKPT_S:-420}"
SPEC_S="${QUILT_GPU_SPEC_S:-240}"
TP_S="${QUILT_GPU_TP_S:-240}"
TRACE_ARGS="${QUILT_GPU_TRACE_ARGS---requests 48 --peft-seconds 10 --peft-max-groups 1 --decode-steps 12 --cold 2}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (docs/gpu.md): none are needed today
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DRY" = 1 ]; then
  BARE="$(mktemp -d)"
  trap 'rm -rf "$BARE"' EXIT
  "$PY" benchmarks/gpu_bare_env.py "$BARE" || exit 1
  export PYTHONPATH="$BARE${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=1
fi

SUMMARY=()
FAILED=0
run_step() {  # name, limit in seconds, command...
  local name="$1" limit="$2" start rc
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  start=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || FAILED=1
  [ "$rc" = 124 ] && rc="124 (time limit)"
  SUMMARY+=("| $name | $rc | $(($(date +%s) - start)) |")
}

env_report() {
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  echo "nproc $(nproc); $(free -g 2>/dev/null | sed -n 2p)"; df -h /tmp | tail -1
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "numpy", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError as exc:
        print(name, "MISSING", exc)
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("cuda", torch.version.cuda, p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs",
          "capability", torch.cuda.get_device_capability(0))
else:
    print("cuda: not available")
EOF
}

gpu_pytest() {  # marker expression, folders...
  local marks="$1" files
  shift
  files=$("$PY" benchmarks/gpu_test_files.py "$@") || return 1
  [ -n "$files" ] || { echo "no test file of $* can be imported here" >&2; return 1; }
  # pytest-django (and its DJANGO_SETTINGS_MODULE in pyproject.toml) is the control plane's: not loaded here
  # shellcheck disable=SC2086
  "$PY" -m pytest -p no:django -p no:faker -p no:schemathesis -p no:cacheprovider -m "$marks" -q -rfEs \
    --durations=10 $files
}

gpu_kernels() {  # the kernel benchmark in three parts, each under its share of the limit; their JSON merged
  local smoke="" part ops rc=0 limit
  [ "$DRY" = 1 ] && smoke="--smoke"
  rm -f "$OUT"/kernels-part-*.json
  for part in "lora:40" "attention:32" "moe:10" "store_kv rms_norm rotary silu gelu:18"; do  # ops:percent of limit
    ops="${part%:*}"
    limit=$((KERNELS_S * ${part##*:} / 100))
    echo "--- kernels.py --only $ops (limit ${limit}s)"
    # shellcheck disable=SC2086
    timeout -s INT -k 10 "$limit" "$PY" benchmarks/kernels.py $smoke --only $ops \
      --json "$OUT/kernels-part-${ops%% *}.json" || rc=1
  done
  "$PY" benchmarks/gpu_merge_kernels.py "$OUT" || rc=1
  return $rc
}

gpu_tp() {  # tensor parallelism: compute against communication per step, at every size the GPUs allow
  if [ "$DRY" = 1 ]; then
    "$PY" -m benchmarks.tensor_parallel --smoke --tp 1 2
    return
  fi
  local sizes
  sizes=$("$PY" -c "import torch; n = torch.cuda.device_count(); print(*[s for s in (1, 2, 4, 8) if s <= n])") || return 1
  "$PY" -m benchmarks.tensor_parallel --device cuda --dtype bfloat16 --hidden 4096 --layers 4 --requests 32 --tp $sizes
}

export -f env_report gpu_pytest gpu_kernels gpu_tp
export PY OUT DRY KERNELS_S
for step in $STEPS; do
  case "$step" in
    env) run_step env 30 bash -c env_report ;;
    pytest) run_step pytest "$PYTEST_S" bash -c 'gpu_pytest gpu tests/kernels tests/engine' ;;
    native) run_step native "$NATIVE_S" bash -c 'gpu_pytest "not gpu" tests/kernels' ;;
    kernels) run_step kernels $((KERNELS_S + 10)) bash -c gpu_kernels ;;
    trace)
      # shellcheck disable=SC2086
      run_step trace "$TRACE_S" "$PY" benchmarks/gpu_trace.py $([ "$DRY" = 1 ] && echo --tiny) \
        --json "$OUT/trace.json" --budget-s $((TRACE_S - 20)) $TRACE_ARGS ;;
    quant)
      # shellcheck disable=SC2086
      if [ "$DRY" = 1 ]; then
        run_step quant "$QUANT_S" "$PY" benchmarks/quantization.py --shape llama-tiny --json "$OUT/quant.json" \
          $QUANT_ARGS --tokens 64 --batch 8 --rounds 1 --decode-steps 2
      else
        run_step quant "$QUANT_S" "$PY" benchmarks/quantization.py --device cuda --shape llama3-8b \
          --json "$OUT/quant.json" $QUANT_ARGS
      fi ;;
    w4a16)
      if [ "$DRY" = 1 ]; then
        run_step w4a16 "$W4A16_S" "$PY" benchmarks/quantized_checkpoints.py --shape llama-tiny --json "$OUT/w4a16.json" \
          --rounds 1 --batches 1 16 --adapters 4
      else
        run_step w4a16 "$W4A16_S" "$PY" benchmarks/quantized_checkpoints.py --device cuda --shape llama3-8b \
          --json "$OUT/w4a16.json"
      fi ;;
    fp8ckpt)
      if [ "$DRY" = 1 ]; then
        run_step fp8ckpt "$FP8CKPT_S" "$PY" benchmarks/fp8_checkpoint.py --shape llama-tiny --json "$OUT/fp8ckpt.json" \
          --rounds 1 --batches 8 --adapters 4
      else
        run_step fp8ckpt "$FP8CKPT_S" "$PY" benchmarks/fp8_checkpoint.py --device cuda --shape llama3-8b \
          --json "$OUT/fp8ckpt.json"
      fi ;;
    spec)
      if [ "$DRY" = 1 ]; then run_step spec "$SPEC_S" "$PY" -m benchmarks.speculative --quick --random-model
      else run_step spec "$SPEC_S" "$PY" -m benchmarks.speculative --device cuda --rounds 3; fi ;;
    tp) run_step tp "$TP_S" bash -c gpu_tp ;;
    *) echo "unknown step $step (env, pytest, native, kernels, trace, quant, w4a16, fp8ckpt, spec, tp)" >&2; exit 2 ;;
  esac
done

{
  echo "## gpu_suite $( [ "$DRY" = 1 ] && echo "DRY RUN on CPU" ) $(date -u +%FT%TZ)"
  echo "| step | rc | seconds |"
  echo "|---|---|---:|"
  printf '%s\n' "${SUMMARY[@]}"
  for log in pytest native; do
    [ -f "$OUT/$log.log" ] && grep -E "^(FAILED|ERROR)|^left out| (passed|failed|error|skipped)" "$OUT/$log.log" | tail -15
  done
  [ -f "$OUT/kernels.log" ] && grep -E "^--- kernels|^[A-Za-z.]*(Error|Exception)|^goal|\| NO \|" "$OUT/kernels.log" | tail -16
  [ -f "$OUT/trace.log" ] && sed -n '/^## gpu_trace/,$p' "$OUT/trace.log"
  [ -f "$OUT/quant.log" ] && sed -n '/^## quantization/,$p' "$OUT/quant.log"
  [ -f "$OUT/w4a16.log" ] && sed -n '/^## W4A16/,$p' "$OUT/w4a16.log"
  [ -f "$OUT/fp8ckpt.log" ] && sed -n '/^## FP8 checkpoint/,$p' "$OUT/fp8ckpt.log"
  [ -f "$OUT/tp.log" ] && grep -E "^\||^greedy|^tp=" "$OUT/tp.log"
} | tee "$OUT/suite.log"
exit $FAILED
