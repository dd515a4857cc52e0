#!/usr/bin/env bash
# The whole GPU check in one device command that ends within DEADLINE seconds (default 545):
#   1. when the training prompts are there (DATA, a copy of the training folder; TRAIN=0 skips it): `specdec
#      distill` answers more training prompts on the GPU (answers already in data/answers/ and the package are
#      skipped) into $OUT/answers (copy its chunk files into data/answers/<model>/ afterwards), then `specdec
#      train` fits the EAGLE-3 head on all the answers, warm-started from the shipped head, with the curve of
#      acceptance against answer tokens trained on (the best head: $OUT/head/best),
#   2. `specdec bench` of the new head as a dynamic tree and as a chain against plain decoding, alternated in one run,
#   3. the lossless suite on the device (`make print-gpu-tests`),
#   4. the plain step with captured graphs against the eager one (tools/verify_cost.py), bfloat16,
#   each in whatever time is left. Results of 2-4 go to $OUT/check.txt (the device returns at most 8 files).
#
# Here, once: bash ../shared/device/prep.sh, then the training prompts alone (22 MB) into the carried part
#     .venv/bin/specdec distill --data-dir ../shared/data/train --export-prompts .dev/pN/train
# (N: the last part), run the stash commands prep.sh prints, and with the last part carried:
#     source .dev/pN/env.sh && DATA=.dev/pN/train bash tools/gpu_check.sh
# Dry run on CPU (checks the script, not the figures):
#     DEVICE=cpu DTYPE=auto PYTHON=.venv/bin/python OUT=/tmp/gpu-dry DATA=../shared/data/train \
#       DISTILL_ARGS="--limit 8" TRAIN_ARGS="--max-conversations 16 --steps 16 --held-out 4" \
#       GEN_S=60 TRAIN_S=60 DEADLINE=400 NUM_PROMPTS=1 MAX_TOKENS=8 bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-gpu_results}
DATA=${DATA:-.dev/p4/train}
ANSWERS=${ANSWERS:-data/answers/smollm2-135m specdec/data/distill/smollm2-135m.npz}
GEN_S=${GEN_S:-150}
TRAIN_S=${TRAIN_S:-200}
DISTILL_ARGS=${DISTILL_ARGS:-}  # word-split, as TRAIN_ARGS
TRAIN_ARGS=${TRAIN_ARGS:-}  # word-split: e.g. "--objective topk --lr 2e-4" (no quotes inside)
DEADLINE=${DEADLINE:-545}
TRAIN=${TRAIN:-$([ -d "$DATA" ] && echo 1 || echo 0)}
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
  timeout "$GEN_S" $PYTHON -m specdec.cli distill --device "$DEVICE" --dtype "$DTYPE" --data-dir "$DATA" \
    data/prompts --out "$OUT/answers" --also $ANSWERS --per-source all --in-flight 512 --flush-every 4000 $DISTILL_ARGS 2>&1 \
    | grep -v -e "answer/s" -e "s/answer" | tee "$OUT/train.txt"
  note "== answers: exit ${PIPESTATUS[0]} after $SECONDS s (124: stopped by its budget, the chunks are kept)"
  # shellcheck disable=SC2086
  timeout "$(left)" $PYTHON -m specdec.cli train --method eagle3 --device "$DEVICE" --dtype "$DTYPE" \
    --data "$DATA" data/prompts --distilled $ANSWERS "$OUT/answers" --out "$OUT/head" --init specdec/heads/smollm2-135m-eagle3 \
    --epochs 1 --batch 16 --train-seconds "$TRAIN_S" --eval-every 50 --ce-weight 1.0 --regression-weight 0.1 \
    --val-prompts 0 $TRAIN_ARGS 2>&1 | grep -v -e "it/s]" -e "s/it]" | tee -a "$OUT/train.txt"
  rc=${PIPESTATUS[0]}
  note "== training: exit $rc after $SECONDS s"
  [ $rc -eq 0 ] || status=1
else
  note "== training: skipped (no training folder at $DATA, or TRAIN=0): the shipped head is benched"
fi
HEAD=$OUT/head/best
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
