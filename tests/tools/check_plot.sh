#!/usr/bin/env bash
# tools/meshtorch-plot with bench/.venv's matplotlib (skipped, exit 77, without it): a run chart
# from two experiments' metrics.jsonl (one with an evaluation line) and the ratios chart of a performance page are PNG files; the
# page's ratio rows are the ones expected; a missing metrics file is named.
#
#   check_plot.sh PYTHON PLOT
set -euo pipefail
python="$1" plot="$2"
"$python" -c 'import matplotlib' 2>/dev/null || { echo "skipped: $python with matplotlib is needed (bench/setup-python)"; exit 77; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
png() { [[ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" == "89504e470d0a1a0a" ]]; }

for run in a b; do
  mkdir -p "$tmp/$run"
  for step in 10 20 30; do
    printf '{"global_step": %d, "running_loss": %s, "tokens_per_s": %d}\n' "$step" "$((40 - step)).5" "$((step * 100))"
  done >"$tmp/$run/metrics.jsonl"
done
# --eval-freq's lines of their own, without running_loss or tokens_per_s (a KeyError before).
printf '{"global_step": 20, "eval_loss": 21.5, "eval_perplexity": 2e9, "eval_tokens": 630, "eval_s": 0.1}\n' >>"$tmp/a/metrics.jsonl"
"$python" "$plot" run "$tmp/a" "$tmp/b" --label one --label two -o "$tmp/run.png" >/dev/null
png "$tmp/run.png" || fail "the run chart is not a PNG file"

cat >"$tmp/page.md" <<'PAGE'
<!-- bench/run:tp -->
| model | variant | meshtorch TP tokens/s | PyTorch TP tokens/s | ours / PyTorch | rank 0 GB |
| --- | --- | ---: | ---: | ---: | ---: |
| llama-tiny | tp2 | 100 | 80 | 1.25 | 0.3 |
| llama-100m | tp2 | 9 | 10 | 0.90 | 2.1 |

| another table | x | y | z | ours / PyTorch | w |
| --- | --- | --- | --- | --- | --- |
| not read | 1 | 2 | 3 | 9.99 | 4 |
<!-- /bench/run:tp -->
<!-- bench/run:compile-time -->
| translation unit | seconds |
| --- | ---: |
| a | 1.0 |
<!-- /bench/run:compile-time -->
PAGE
out="$("$python" "$plot" ratios "$tmp/page.md" -o "$tmp/ratios.png")"
[[ "$out" == *"(2 rows)"* ]] || fail "expected the first table's 2 ratio rows, got: $out"
png "$tmp/ratios.png" || fail "the ratios chart is not a PNG file"

if "$python" "$plot" run "$tmp/none" -o "$tmp/x.png" 2>"$tmp/err"; then fail "a folder without metrics.jsonl was accepted"; fi
grep -q "$tmp/none/metrics.jsonl does not exist" "$tmp/err" || fail "the missing file is not named: $(cat "$tmp/err")"
echo "meshtorch-plot: run and ratios charts written; 2 ratio rows read from the first table"
