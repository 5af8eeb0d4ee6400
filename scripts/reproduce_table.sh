#!/usr/bin/env bash
# Reproduce the DropMatch paper's EAGLE-3 table (method, tree, tau, tokens/s, speedup, GSM8K accuracy,
# MT-Bench score, Alpaca win rate) end to end.
#
# Here, on the embedded default (SmolLM2-135M-Instruct + the bundled head, CPU, bf16):
#     bash scripts/reproduce_table.sh
# GPT-4 judging runs only when a judge endpoint is configured (OPENAI_API_KEY, optionally JUDGE_BASE_URL
# for any OpenAI-compatible server); otherwise the judge-free quality report stands in for it.
#
# The same run for Llama-3.3-70B-Instruct with its EAGLE-3 head on GPUs (local folders; 2+ H100/A100-80G):
#     MODEL="--model-path /models/Llama-3.3-70B-Instruct --ea-model-path /models/EAGLE3-LLaMA3.3-Instruct-70B" \
#     DEVICE=auto TREE="--total-token 60 --depth 7 --top-k 10" MAX_NEW_TOKENS=1024 QUESTIONS=80 \
#     OUT=runs/llama70b bash scripts/reproduce_table.sh
#
# Environment: MODEL (gen flags naming target/head; default: the embedded default), DEVICE (cpu), DTYPE
# (bfloat16), TREE (the gen defaults), MAX_NEW_TOKENS (256), QUESTIONS (80), DM ("--dropmatch-k 5 --dropout-p
# 0.3"), JUDGE_MODEL (gpt-4), JUDGE_BASE_URL, OUT (runs/table).
set -euo pipefail
MODEL=${MODEL:-}
DEVICE=${DEVICE:-cpu}
DTYPE=${DTYPE:-bfloat16}
TREE=${TREE:-}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
QUESTIONS=${QUESTIONS:-80}
DM=${DM:---dropmatch-k 5 --dropout-p 0.3}
JUDGE_MODEL=${JUDGE_MODEL:-gpt-4}
OUT=${OUT:-runs/table}
COMMON="$MODEL --device $DEVICE --dtype $DTYPE --max-new-tokens $MAX_NEW_TOKENS --question-end $QUESTIONS $TREE"

for bench in mt_bench gsm8k alpaca; do
  python -m eagle_dropmatch.gen $COMMON --bench "$bench" --baseline --answer-file "$OUT/$bench/baseline.jsonl"
  python -m eagle_dropmatch.gen $COMMON --bench "$bench" --answer-file "$OUT/$bench/eagle3.jsonl"
  python -m eagle_dropmatch.gen $COMMON --bench "$bench" $DM --answer-file "$OUT/$bench/dropmatch.jsonl"
done

for m in baseline eagle3 dropmatch; do
  python -m evaluation.gsm8k --answer-file "$OUT/gsm8k/$m.jsonl" --json --output "$OUT/gsm8k_$m.json" >/dev/null
done
python -m evaluation.speed --answer-file "$OUT/mt_bench/eagle3.jsonl" "$OUT/mt_bench/dropmatch.jsonl" \
  --baseline-file "$OUT/mt_bench/baseline.jsonl" --json --output "$OUT/speed.json" >/dev/null
python -m evaluation.quality --answer-file "$OUT/mt_bench/dropmatch.jsonl" \
  --reference-file "$OUT/mt_bench/eagle3.jsonl" --sbert --json --output "$OUT/quality_dropmatch.json" >/dev/null

JUDGE_ARGS=()
if [[ -n "${OPENAI_API_KEY:-}" || -n "${JUDGE_BASE_URL:-}" ]]; then
  url=()
  [[ -n "${JUDGE_BASE_URL:-}" ]] && url=(--base-url "$JUDGE_BASE_URL")
  for m in baseline eagle3 dropmatch; do
    python -m evaluation.judge single --answer-file "$OUT/mt_bench/$m.jsonl" --judge-model "$JUDGE_MODEL" \
      "${url[@]}" --parallel 4 --json --output "$OUT/judge_$m.json" >/dev/null
    JUDGE_ARGS+=(--judge "$m=$OUT/judge_$m.json")
  done
  for m in eagle3 dropmatch; do
    python -m evaluation.judge pairwise --answer-file "$OUT/alpaca/$m.jsonl" \
      --baseline-file "$OUT/alpaca/baseline.jsonl" --judge-model "$JUDGE_MODEL" "${url[@]}" --parallel 4 \
      --json --output "$OUT/winrate_$m.json" >/dev/null
    JUDGE_ARGS+=(--judge "$m=$OUT/winrate_$m.json")
  done
else
  echo "no judge endpoint (OPENAI_API_KEY / JUDGE_BASE_URL): MT-Bench score and win rate left out" >&2
fi

python -m evaluation.report --run "eagle3=$OUT/mt_bench/eagle3.jsonl" --run "dropmatch=$OUT/mt_bench/dropmatch.jsonl" \
  --baseline-file "$OUT/mt_bench/baseline.jsonl" \
  --gsm8k "baseline=$OUT/gsm8k_baseline.json" --gsm8k "eagle3=$OUT/gsm8k_eagle3.json" \
  --gsm8k "dropmatch=$OUT/gsm8k_dropmatch.json" --quality "dropmatch=$OUT/quality_dropmatch.json" \
  "${JUDGE_ARGS[@]}" --out "$OUT/report"
