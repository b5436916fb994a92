#!/usr/bin/env bash
# meshtorch-tokenize on the checked-in fixture: plain lines and --json lines give the ids that the
# `tokenizers` package gave (fixtures/bpe/expected.jsonl), and --decode gives the text back.
#
#   check_tokenize_tool.sh TOOL FIXTURES
set -euo pipefail
tool="$1" fixtures="$2"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Line 1 of the corpus is plain ASCII without newlines: usable as a raw line.
text="$(head -n1 "$fixtures/corpus.jsonl" | sed -e 's/^"//' -e 's/"$//')"
want="$(head -n1 "$fixtures/bpe/expected.jsonl" | tr -d ' ')"
got="$(printf '%s\n' "$text" | "$tool" "$fixtures/bpe")"
[[ "$got" == "$want" ]] || fail "ids of '$text': got $got, want $want"
back="$(printf '%s\n' "$got" | "$tool" "$fixtures/bpe" --decode)"
[[ "$back" == "$text" ]] || fail "decoded '$back', want '$text'"

# Every corpus text (newlines, special tokens, CJK, emoji) through --json, on 2 threads.
"$tool" "$fixtures/bpe" --json -t 2 <"$fixtures/corpus.jsonl" >"$tmp/ids.jsonl"
tr -d ' ' <"$fixtures/bpe/expected.jsonl" >"$tmp/want.jsonl"
cmp -s "$tmp/ids.jsonl" "$tmp/want.jsonl" || { diff "$tmp/ids.jsonl" "$tmp/want.jsonl" | head -n 6; fail "--json ids differ from the tokenizers package's"; }
[[ $(wc -l <"$tmp/ids.jsonl") -eq $(wc -l <"$fixtures/corpus.jsonl") ]] || fail "not one output line per input line"

# The SentencePiece fixture, chosen because the folder holds tokenizer.model only.
"$tool" "$fixtures/sentencepiece" --json <"$fixtures/corpus.jsonl" >"$tmp/sp.jsonl"
tr -d ' ' <"$fixtures/sentencepiece/expected.jsonl" >"$tmp/sp-want.jsonl"
cmp -s "$tmp/sp.jsonl" "$tmp/sp-want.jsonl" || { diff "$tmp/sp.jsonl" "$tmp/sp-want.jsonl" | head -n 6; fail "SentencePiece ids differ from the sentencepiece package's"; }

# Bad input names the line.
if printf '[1, 2]\nnot json\n' | "$tool" "$fixtures/bpe" --decode >/dev/null 2>"$tmp/err"; then fail "--decode accepted a line that is not JSON"; fi
grep -q "standard input line 2" "$tmp/err" || fail "the error does not name line 2: $(cat "$tmp/err")"
echo "meshtorch-tokenize: ids equal the reference on $(wc -l <"$fixtures/corpus.jsonl") texts, both tokenizers"
