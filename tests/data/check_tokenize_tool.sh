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
# A line nested 100,000 deep is a named error in each stdin mode, not a stack overflow.
python3 -c 'print("[" * 100000 + "]" * 100000)' >"$tmp/deep.txt"
mkdir "$tmp/chat" && cp "$fixtures/bpe/"* "$tmp/chat/"
echo '{% for m in messages %}{{ m.content }}{% endfor %}' >"$tmp/chat/chat_template.jinja"
for mode in --decode --json --chat-text; do
  if "$tool" "$tmp/chat" $mode <"$tmp/deep.txt" >/dev/null 2>"$tmp/err"; then fail "$mode accepted a line nested 100,000 deep"; fi
  grep -q "standard input line 1: nested deeper than" "$tmp/err" || fail "$mode: $(head -c 300 "$tmp/err")"
done
# --prepare: the corpus as a JSONL data set tokenised into its cache (the fixture's <bos>/<eos>
# around each text), then found current on the second call.
mkdir "$tmp/data"
python3 -c 'import json, sys; [print(json.dumps({"text": json.loads(l)})) for l in open(sys.argv[1]) if l.strip()]' \
  "$fixtures/corpus.jsonl" >"$tmp/data/train.jsonl"
first="$("$tool" "$fixtures/bpe" --prepare "$tmp/data" -t 2)"
second="$("$tool" "$fixtures/bpe" --prepare "$tmp/data")"
texts=$(wc -l <"$fixtures/corpus.jsonl")
ids=$(python3 -c 'import json, sys; print(sum(len(json.loads(l)) + 2 for l in open(sys.argv[1])))' "$tmp/want.jsonl")
python3 - "$first" "$second" "$texts" "$ids" <<'PY' || fail "--prepare: $first / $second"
import json, os, sys
first, second = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert first["written"] and not second["written"], (first, second)
assert first["cache"] == second["cache"] and os.path.exists(first["cache"]), first
assert first["documents"] == int(sys.argv[3]) and first["tokens"] == int(sys.argv[4]), (first, sys.argv[3:])
PY
if "$tool" "$fixtures/bpe" --prepare "$tmp/data" --dataset-subset nope >/dev/null 2>"$tmp/err"; then fail "--prepare accepted a missing subset"; fi
grep -q "has no such subfolder" "$tmp/err" || fail "the missing subset is not named: $(cat "$tmp/err")"

echo "meshtorch-tokenize: ids equal the reference on $(wc -l <"$fixtures/corpus.jsonl") texts, both tokenizers"
