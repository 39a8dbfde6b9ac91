#!/usr/bin/env bash
# Quilt's GPU suite: one call of the device tool, under 9 minutes, everything under $OUT (docs/gpu.md).
#
#   bash benchmarks/gpu_suite.sh              # on the GPU machine (Python 3.12, torch, triton, transformers, peft)
#   bash benchmarks/gpu_suite.sh --dry-run    # here, on CPU: the same steps on tiny shapes (also QUILT_GPU_SUITE_DRY=1)
#
# Preparation, before any step (docs/gpu.md "How to call it"): the wheels the image lacks (llguidance, starlette,
# uvicorn, celery, kombu, redis, sqlalchemy, jsonschema and what they need), fetched HERE beforehand by
# `python benchmarks/gpu_wheels.py .whl` and carried (`carry=[".whl"]`), are installed with pip --no-index into
# /tmp/site, and the engine must then import (its server, usage emitter and grammar included) -> env.log.
# The dry run does the same from `.whl-local` (`python benchmarks/gpu_wheels.py --local .whl-local`: the same pins
# for this Python), in front of stubs that make every package the image lacks fail to import.
#
# Steps (QUILT_GPU_STEPS picks them, default "env pytest precision kernels trace"), each under its own limit:
#   env       device, driver, versions                                        -> env.log
#   pytest    pytest -m gpu over tests/kernels and tests/engine, 4 xdist       -> pytest.log
#             workers by file (Triton compiles on 4 cores at once)
#   precision benchmarks/gpu_precision.py: engine bf16 and transformers + PEFT -> precision.log
#             bf16, each against PEFT in float32 on the same weights
#   native    the other tests/kernels tests (float32), natively on CUDA       -> native.log   (not by default)
#   kernels   benchmarks/kernels.py (Llama-3-8B shapes, bf16; the experts of   -> kernels.log, kernels.json
#             Qwen3-30B-A3B: grouped_matmul, expert_lora; lora_delta's
#             candidate configurations side by side; the W4A16 and fp8
#             block GEMMs at decode shapes against bf16), 6 parts
#   trace     benchmarks/gpu_trace.py (8B shape, adapters, PEFT, TTFT; the     -> trace.log, trace.json
#             profile of decode steps right after the decode phase)
#   quant     benchmarks/quantization.py (8B shape: fp8 weights, fp8 KV,       -> quant.log, quant.json   (not by
#             int8 against bf16: memory, decode tok/s, agreement)                 default: QUILT_GPU_STEPS="env quant")
#   w4a16     benchmarks/quantized_checkpoints.py --suite w4a16 (8B shape: a  -> w4a16.log, w4a16.json (not by
#             GPTQ W4A16 g128 checkpoint against bf16, decode tok/s at batch      default: QUILT_GPU_STEPS="env
#             1/16/64, 16 adapters; goals >= 2.5x at 1-16, >= 1.3x at 64)        w4a16"; QUILT_GPU_W4A16_S, 360)
#   fp8ckpt   benchmarks/quantized_checkpoints.py --suite fp8ckpt (8B shape:   -> fp8ckpt.log, fp8ckpt.json (not
#             an fp8 weight_block_size [128, 128] checkpoint against bf16,        by default: QUILT_GPU_STEPS="env
#             decode tok/s at batch 64, 16 adapters; goal >= 1.6x)                fp8ckpt"; QUILT_GPU_FP8CKPT_S, 420)
#   spec      benchmarks/speculative.py on CUDA (demo model, on vs off)        -> spec.log     (not by default)
#   tp        benchmarks/tensor_parallel.py at tp 1, 2, 4, 8 as the GPUs allow -> tp.log   (not by default:
#             it needs 2+ GPUs to say anything; the dry run runs it on 2 CPU ranks; QUILT_GPU_TP_S, 240)
#   cold      benchmarks/cold_cliff.py on CUDA: 8 adapters of real size (rank  -> cold.log, cold.json (not by
#             16, 7 projections, 8B-shape layers) in a pool that holds 4,         default: QUILT_GPU_STEPS="env
#             TTFT against all resident, uniform and Zipf, 3 runs                 cold"; QUILT_GPU_COLD_S, 300;
#                                                                                 QUILT_GPU_COLD_ARGS)
#   vlm       benchmarks/vlm.py on CUDA in bf16, per family (Qwen2.5-VL 7B,   -> vlm.log (not by default:
#             Qwen3-VL 8B, Gemma 3 4B: the whole vision tower, 4 decoder          QUILT_GPU_STEPS="env vlm";
#             layers at full width, photo-sized pictures): image requests         QUILT_GPU_VLM_S, 540;
#             against transformers + PEFT, N images in one encode against N       QUILT_GPU_VLM_ARGS,
#             single ones, 3 rounds each                                          QUILT_GPU_VLM_FAMILIES)
#   kv        benchmarks/kv_transfer.py on CUDA: a 2k-token Llama-3-8B        -> kv.log (not by default:
#             prefill's blocks (128 x 2 MiB) between two processes' pools on     QUILT_GPU_STEPS="env kv";
#             the GPU, nixl (UCX_TLS=cuda_ipc,cuda_copy,tcp) against tcp and     QUILT_GPU_KV_S, 240)
#             shm, 3 runs; goal: nixl >= 20 GB/s
# and suite.log, the table printed last. The device tool brings back at most 8 files: the default run writes
# exactly env.log pytest.log precision.log kernels.log kernels.json trace.log trace.json suite.log.
# The dry run runs the kernels in Triton's interpreter (--smoke) and the trace on a tiny model (--tiny).
# Limits in seconds: wheels 15 (pip) + 15 (the import check), env 25, QUILT_GPU_PYTEST_S (140; it was 125, which
# Triton's compiling overran on an H200, then 155: it took 103 s there), QUILT_GPU_PRECISION_S (40; 75, then 50:
# it took 27 s on the H200), QUILT_GPU_KERNELS_S (160; 105 before the lora_delta configurations, 130 before the
# quantized GEMMs, + 10 s to merge the kernels' JSON), QUILT_GPU_TRACE_S (145; 150 before the quantized GEMMs), QUILT_GPU_NATIVE_S (120), QUILT_GPU_QUANT_S (420): the default steps
# take at most 550 s (about 9 minutes; each ends sooner when its work does), "env quant" 475 s;
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
rm -f "$OUT"/*.log  # the steps append (env.log begins with the wheels)
STEPS="${QUILT_GPU_STEPS:-env pytest precision kernels trace}"
ENV_S=25 WHEELS_S=15  # WHEELS_S: the pip install, and again the import check
PYTEST_S="${QUILT_GPU_PYTEST_S:-140}"
PRECISION_S="${QUILT_GPU_PRECISION_S:-40}"
NATIVE_S="${QUILT_GPU_NATIVE_S:-120}"
KERNELS_S="${QUILT_GPU_KERNELS_S:-160}"
TRACE_S="${QUILT_GPU_TRACE_S:-145}"
QUANT_S="${QUILT_GPU_QUANT_S:-420}"
W4A16_S="${QUILT_GPU_W4A16_S:-360}"
FP8CKPT_S="${QUILT_GPU_FP8CKPT_S:-420}"
QUANT_ARGS="${QUILT_GPU_QUANT_ARGS---layers 16 --rounds 2}"
SPEC_S="${QUILT_GPU_SPEC_S:-240}"
TP_S="${QUILT_GPU_TP_S:-240}"
COLD_S="${QUILT_GPU_COLD_S:-300}"
VLM_S="${QUILT_GPU_VLM_S:-540}"
KV_S="${QUILT_GPU_KV_S:-240}"
VLM_ARGS="${QUILT_GPU_VLM_ARGS---rounds 3 --requests 16 --max-tokens 32 --images 8 --layers 4}"
VLM_FAMILIES="${QUILT_GPU_VLM_FAMILIES:-qwen2_5_vl qwen3_vl gemma3}"
COLD_ARGS="${QUILT_GPU_COLD_ARGS---layers 8 --requests 200 --rate 20 --prompt 128 --max-tokens 16 --kv-blocks 36}"
if [ "$DRY" = 1 ]; then  # the interpreter on a shared CPU: the GPU's limits, times QUILT_GPU_DRY_SLOWDOWN (3)
  SLOW="${QUILT_GPU_DRY_SLOWDOWN:-3}"
  ENV_S=$((ENV_S * SLOW)) WHEELS_S=$((WHEELS_S * SLOW)) PYTEST_S=$((PYTEST_S * SLOW)) PRECISION_S=$((PRECISION_S * SLOW)) KERNELS_S=$((KERNELS_S * SLOW))
  TRACE_S=$((TRACE_S * SLOW)) NATIVE_S=$((NATIVE_S * SLOW)) VLM_S=$((VLM_S * SLOW))
fi
TRACE_ARGS="${QUILT_GPU_TRACE_ARGS---requests 48 --peft-seconds 10 --peft-max-groups 1 --decode-steps 12 --cold 2}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONUNBUFFERED=1

SUMMARY=()
FAILED=0
if [ "$DRY" = 1 ]; then
  BARE="$(mktemp -d)"
  trap 'rm -rf "$BARE"' EXIT
  "$PY" benchmarks/gpu_bare_env.py "$BARE/stubs" || exit 1
  export PYTHONPATH="$BARE/stubs${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=1
  SITE="$BARE/site" WHEELS="${QUILT_GPU_WHEELS:-.whl-local}"
else
  SITE=/tmp/site WHEELS="${QUILT_GPU_WHEELS:-.whl}"
fi
prepare_wheels() {  # install the carried wheels; then the engine (server, usage, grammar) must import
  local start rc
  start=$(date +%s)
  (
    set -o pipefail
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
      echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
      timeout "$WHEELS_S" "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
    else
      echo "no wheels in $WHEELS: run 'python benchmarks/gpu_wheels.py $WHEELS' here first and carry it"
    fi
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout "$WHEELS_S" "$PY" -c "
import engine, engine.grammar, engine.server.app, engine.usage.emitter, jsonschema, kombu
print('wheels: the engine imports, its server and usage emitter included')"
  ) 2>&1 | tee -a "$OUT/env.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || FAILED=1
  SUMMARY+=("| wheels | $rc | $(($(date +%s) - start)) |")
}
prepare_wheels
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

run_step() {  # name, limit in seconds, command...
  local name="$1" limit="$2" start rc
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  start=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"  # -a: env.log begins with the wheels
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
  # only the plugins the suite needs (pytest-django, the control plane's, is not on the image; its
  # DJANGO_SETTINGS_MODULE in pyproject.toml then draws only a warning)
  # shellcheck disable=SC2086
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p pytest_timeout -p xdist -p no:cacheprovider -m "$marks" -q \
    -rfEs --durations=10 -n "${QUILT_GPU_PYTEST_WORKERS:-$([ "$DRY" = 1 ] && echo 2 || echo 4)}" --dist loadfile $files
}

gpu_kernels() {  # the kernel benchmark in five parts, each under its share of the limit; their JSON merged
  local smoke="" part ops rc=0 limit status
  [ "$DRY" = 1 ] && smoke="--smoke"
  rm -f "$OUT"/kernels-part-*.json
  # ops:percent of the limit (the parts before the quantized GEMMs kept their seconds when the limit grew from 130
  # to 160); lora_delta_configs after lora (Triton's disk cache holds the plans it compiled); the two sweeps, cut
  # short by their limits, keep the shapes they measured
  for part in "lora:26" "lora_delta_configs:16" "wna16 fp8_block:19" "attention:21" "moe:7" \
    "store_kv rms_norm rotary silu gelu:11"; do
    ops="${part%:*}"
    limit=$((KERNELS_S * ${part##*:} / 100))
    echo "--- kernels.py --only $ops (limit ${limit}s)"
    # shellcheck disable=SC2086
    timeout -s INT -k 10 "$limit" "$PY" benchmarks/kernels.py $smoke --only $ops \
      --json "$OUT/kernels-part-${ops%% *}.json"
    status=$?
    if [ "$status" = 124 ] && { [ "$ops" = lora_delta_configs ] || [ "$ops" = "wna16 fp8_block" ]; }; then
      echo "$ops: cut short by its limit, by design (it kept what it measured)"
    elif [ "$status" != 0 ]; then
      rc=1
    fi
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

gpu_vlm() {  # each family in turn; a family that fails does not stop the next (the step's rc says one did)
  local family rc=0
  for family in $VLM_FAMILIES; do
    echo "--- vlm $family"
    if [ "$DRY" = 1 ]; then  # the tiny shape on CPU, in float32: the wiring
      "$PY" -m benchmarks.vlm --family "$family" --rounds 1 --requests 2 --max-tokens 2 --images 2 || rc=1
    else
      # shellcheck disable=SC2086
      "$PY" -m benchmarks.vlm --family "$family" --device cuda --dtype bfloat16 --shape real $VLM_ARGS || rc=1
    fi
  done
  return $rc
}

export -f env_report gpu_pytest gpu_kernels gpu_tp gpu_vlm
export PY OUT DRY KERNELS_S VLM_ARGS VLM_FAMILIES
for step in $STEPS; do
  case "$step" in
    env) run_step env "$ENV_S" bash -c env_report ;;
    pytest) run_step pytest "$PYTEST_S" bash -c 'gpu_pytest gpu tests/kernels tests/engine' ;;
    precision)
      if [ "$DRY" = 1 ]; then run_step precision "$PRECISION_S" "$PY" benchmarks/gpu_precision.py --tiny
      else run_step precision "$PRECISION_S" "$PY" benchmarks/gpu_precision.py --device cuda; fi ;;
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
    w4a16 | fp8ckpt)  # one benchmark, a suite per format
      limit="$W4A16_S" dry_batches="1 16"
      [ "$step" = fp8ckpt ] && limit="$FP8CKPT_S" dry_batches=8
      if [ "$DRY" = 1 ]; then
        # shellcheck disable=SC2086
        run_step "$step" "$limit" "$PY" benchmarks/quantized_checkpoints.py --suite "$step" --shape llama-tiny \
          --json "$OUT/$step.json" --rounds 1 --batches $dry_batches --adapters 4
      else
        run_step "$step" "$limit" "$PY" benchmarks/quantized_checkpoints.py --suite "$step" --device cuda \
          --shape llama3-8b --json "$OUT/$step.json"
      fi ;;
    spec)
      if [ "$DRY" = 1 ]; then run_step spec "$SPEC_S" "$PY" -m benchmarks.speculative --quick --random-model
      else run_step spec "$SPEC_S" "$PY" -m benchmarks.speculative --device cuda --rounds 3; fi ;;
    tp) run_step tp "$TP_S" bash -c gpu_tp ;;
    cold)
      # shellcheck disable=SC2086
      if [ "$DRY" = 1 ]; then
        run_step cold "$COLD_S" "$PY" -m benchmarks.cold_cliff --tiny --adapters 4 --requests 6 --rate 4 --runs 1 \
          --dtype float32 --json "$OUT/cold.json"
      else
        run_step cold "$COLD_S" "$PY" -m benchmarks.cold_cliff --device cuda $COLD_ARGS --json "$OUT/cold.json"
      fi ;;
    vlm) run_step vlm "$VLM_S" bash -c gpu_vlm ;;
    kv)
      if [ "$DRY" = 1 ]; then
        run_step kv "$KV_S" env UCX_TLS=tcp "$PY" -m benchmarks.kv_transfer --shape tiny --requests 2 --runs 1
      else
        run_step kv "$KV_S" env UCX_TLS=cuda_ipc,cuda_copy,tcp "$PY" -m benchmarks.kv_transfer --device cuda \
          --shape llama-8b-2k --requests 5 --runs 3 --goal-gbps 20
      fi ;;
    *) echo "unknown step $step (env, pytest, precision, native, kernels, trace, quant, w4a16, fp8ckpt, spec, tp, cold, vlm, kv)" >&2; exit 2 ;;
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
  [ -f "$OUT/kernels.log" ] && grep -E "^--- kernels|^[A-Za-z.]*(Error|Exception)|^goal|^best |^lora_delta configurations: stopped|^quantized GEMMs: stopped|\| NO \|" "$OUT/kernels.log" | tail -56
  grep -E "^wheels:|^no wheels|^installing" "$OUT/env.log" 2>/dev/null
  [ -f "$OUT/precision.log" ] && sed -n '/^## gpu_precision/,$p' "$OUT/precision.log"
  [ -f "$OUT/trace.log" ] && sed -n '/^## gpu_trace/,$p' "$OUT/trace.log"
  [ -f "$OUT/quant.log" ] && sed -n '/^## quantization/,$p' "$OUT/quant.log"
  [ -f "$OUT/w4a16.log" ] && sed -n '/^## W4A16/,$p' "$OUT/w4a16.log"
  [ -f "$OUT/fp8ckpt.log" ] && sed -n '/^## FP8 checkpoint/,$p' "$OUT/fp8ckpt.log"
  [ -f "$OUT/tp.log" ] && grep -E "^\||^greedy|^tp=" "$OUT/tp.log"
  [ -f "$OUT/kv.log" ] && sed -n '/^over /,$p' "$OUT/kv.log"
  [ -f "$OUT/vlm.log" ] && grep -E "^--- vlm|image requests: |images in one encoder call|^[A-Za-z.]*(Error|Exception)" "$OUT/vlm.log"
} | tee "$OUT/suite.log"
exit $FAILED
