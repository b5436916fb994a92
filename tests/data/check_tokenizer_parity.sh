#!/usr/bin/env bash
# Tokenizer parity with the Python packages, on tokenizers trained afresh by make_tokenizers.py
# (a byte-level BPE with Llama 3's pre-tokenizer from `tokenizers`, a Llama 2 style model from
# `sentencepiece`, up to 2000 tokens each): on the varied corpus, meshtorch-tokenize's ids equal the
# package's, on 1 and 2 threads, and decode(encode(x)) == x.
# Exit 77 (CTest: skipped) when the bench environment (bench/setup-python) is not installed.
#
#   check_tokenizer_parity.sh VENV_PYTHON TOOL MAKE_TOKENIZERS_PY
set -euo pipefail
python="$1" tool="$2" make="$3"
if [[ ! -x "$python" ]] || ! "$python" -c 'import tokenizers, sentencepiece' 2>/dev/null; then
  echo "skipped: no bench environment with tokenizers and sentencepiece at $python (install it with bench/setup-python)"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$python" "$make" train "$tmp" --bpe-vocab 2000 --sp-vocab 2000
"$python" "$make" corpus "$tmp/corpus.jsonl"
for kind in bpe sentencepiece; do
  "$python" "$make" expect "$tmp/$kind" "$tmp/corpus.jsonl" "$tmp/$kind.want.jsonl"
  tr -d ' ' <"$tmp/$kind.want.jsonl" >"$tmp/$kind.want"
  for threads in 1 2; do
    "$tool" "$tmp/$kind" --json -t "$threads" <"$tmp/corpus.jsonl" >"$tmp/$kind.got"
    if ! cmp -s "$tmp/$kind.got" "$tmp/$kind.want"; then
      line=$(cmp "$tmp/$kind.got" "$tmp/$kind.want" | awk '{print $NF}')
      echo "text:   $(sed -n "${line}p" "$tmp/corpus.jsonl")"
      echo "ours:   $(sed -n "${line}p" "$tmp/$kind.got")"
      echo "theirs: $(sed -n "${line}p" "$tmp/$kind.want")"
      fail "$kind ids differ on $threads thread(s) at line $line"
    fi
  done
  "$tool" "$tmp/$kind" --decode --json <"$tmp/$kind.got" >"$tmp/$kind.back"
  # An added token with lstrip takes the spaces before it, as in HF; that one text cannot come back whole.
  if ! diff <(grep -v '<mask>' "$tmp/corpus.jsonl") <(grep -v '<mask>' "$tmp/$kind.back") >"$tmp/diff"; then
    head -n 6 "$tmp/diff"
    fail "$kind: decode(encode(x)) != x"
  fi
  echo "$kind: ids equal the package's on $(wc -l <"$tmp/corpus.jsonl") texts; decode(encode(x)) == x"
done
