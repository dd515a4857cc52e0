#!/usr/bin/env bash
# The whole GPU check in one device command that ends within DEADLINE seconds (default 545):
#   1. when the training prompts are there (PROMPTS; TRAIN=0 skips it), tools/train_head_gpu.py: the target
#      answers more training prompts (the earlier answers, ANSWERS, are
#      kept), the EAGLE-3 head trains on them all, the curve of acceptance against tokens trained on; the head,
#      its log and all the answers go to $OUT (copy answers-*.npz over specdec/data/answers/ afterwards),
#   2. `specdec bench` of the new head as a dynamic tree and as a chain against plain decoding, alternated in one run,
#   3. the lossless suite on the device (`make print-gpu-tests`),
#   4. the plain step with captured graphs against the eager one (tools/verify_cost.py), bfloat16,
#   each in whatever time is left. Results of 2-4 go to $OUT/check.txt (the device returns at most 8 files).
# Measured on an H200 (2026-11-27): loading takes 30 s, answering about 9k answer tokens/s, the checks 2-4
# about 60 + 110 + 30 s.
#
# Here, once: bash ../shared/device/prep.sh, then
#     .venv/bin/python tools/train_head_gpu.py prompts --data-dir ../shared/data/train --out .dev/pN/prompts.jsonl.gz
# (N: the last part), run the stash commands prep.sh prints, and with the last part carried:
#     source .dev/pN/env.sh && PROMPTS=.dev/pN/prompts.jsonl.gz bash tools/gpu_check.sh
# Dry run on CPU (checks the script, not the figures):
#     DEVICE=cpu DTYPE=float32 PYTHON=.venv/bin/python OUT=/tmp/gpu-dry PROMPTS=/tmp/prompts.jsonl.gz \
#       TRAIN_ARGS="--max-prompts 300 --held-out 4 --max-new-tokens 16 --gen-batch 8 --batch-tokens 1024" \
#       GEN_S=20 TRAIN_S=20 DEADLINE=400 NUM_PROMPTS=1 MAX_TOKENS=8 bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-gpu_results}
PROMPTS=${PROMPTS:-.dev/p3/prompts.jsonl.gz}
ANSWERS=${ANSWERS:-$(ls specdec/data/answers/*.npz 2>/dev/null)}
GEN_S=${GEN_S:-150}
TRAIN_S=${TRAIN_S:-200}
# who answers: transformers' generate (ran on an H200) unless GENERATOR=auto tries specdec's engine too (not yet
# run on a GPU at batch > 1: a CUDA fault there would end the whole command, training included)
GENERATOR=${GENERATOR:-hf}
TRAIN_ARGS=${TRAIN_ARGS:-}  # word-split: e.g. "--init none --lr 2e-4" (no quotes inside)
DEADLINE=${DEADLINE:-545}
TRAIN=${TRAIN:-$([ -f "$PROMPTS" ] && echo 1 || echo 0)}
NUM_PROMPTS=${NUM_PROMPTS:-10}
MAX_TOKENS=${MAX_TOKENS:-128}
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
CHECK=$OUT/check.txt
: > "$CHECK"
status=0
left() { echo $((DEADLINE - SECONDS)); }
note() { echo "$*" | tee -a "$CHECK"; }
# run NAME MIN_SECONDS CMD...: CMD under the time left (skipped when less than MIN_SECONDS is), output to check.txt
run() {
  local name=$1 min=$2; shift 2
  local t; t=$(left)
  if [ "$t" -lt "$min" ]; then note "== $name: skipped, ${t}s left"; return; fi
  note "== $name (limit ${t}s): $*"
  timeout "$t" "$@" >> "$CHECK" 2>&1
  local rc=$?
  note "== $name: exit $rc after $SECONDS s in all"
  [ $rc -eq 0 ] || status=1
}

note "== device: $($PYTHON -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if '$DEVICE' == 'cuda' else 'cpu')")"
# 1. the head (its own log: train.txt)
if [ "$TRAIN" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "$(left)" $PYTHON tools/train_head_gpu.py train --prompts "$PROMPTS" --out "$OUT" --device "$DEVICE" \
    --dtype "$DTYPE" --gen-seconds "$GEN_S" --train-seconds "$TRAIN_S" --answers $ANSWERS --state /tmp/head-state \
    --generator "$GENERATOR" $TRAIN_ARGS 2>&1 | grep -v -e "it/s]" -e "s/it]" | tee "$OUT/train.txt"
  rc=${PIPESTATUS[0]}
  note "== training: exit $rc after $SECONDS s"
  [ $rc -eq 0 ] || status=1
else
  note "== training: skipped (no prompts at $PROMPTS, or TRAIN=0): the shipped head is benched"
fi
HEAD=$OUT/head
[ -f "$HEAD/config.json" ] || HEAD=specdec/heads/smollm2-135m-eagle3
# 2. the head as an EAGLE-2 dynamic tree (verification is nearly free on a GPU) and as a chain against plain
#    decoding, alternated in one run each
for spec in "{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 15, \"tree\": {\"topk\": 4, \"num_steps\": 4, \"num_draft_tokens\": 15}}" \
            "{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 3}"; do
  run "bench $spec" 45 $PYTHON -m specdec.cli bench --model smollm2-135m --device "$DEVICE" --dtypes "$DTYPE" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --speculative-config "$spec" --out /tmp/bench.json
done
# 3. the lossless suite
# shellcheck disable=SC2046
run "tests --device $DEVICE" 30 $PYTHON -m pytest -q --maxfail=5 -p no:cacheprovider --device "$DEVICE" \
  $(make -s -f Makefile print-gpu-tests)
# 4. a plain step with captured graphs against eager, and what verifying n tokens costs
run "verification cost, graphs" 20 $PYTHON tools/verify_cost.py --model smollm2-135m --dtype "$DTYPE" \
  --device "$DEVICE" --contexts 300 --tokens 1,2,4,8
run "verification cost, eager" 15 $PYTHON tools/verify_cost.py --model smollm2-135m --dtype "$DTYPE" \
  --device "$DEVICE" --contexts 300 --tokens 1,4 --enforce-eager
note "== done (exit $status) after $SECONDS s"
exit $status
