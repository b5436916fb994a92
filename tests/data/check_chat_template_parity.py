"""Chat-template parity with transformers' apply_chat_template, on real models' templates.

  check_chat_template_parity.py TOOL TEMPLATES_DIR

For each chat template in TEMPLATES_DIR (the real models' templates scripts/setup unpacks beside
minja, .deps/minja/templates), a model folder is written by transformers itself (save_pretrained:
chat_template.jinja beside tokenizer.json, whose byte-level BPE make_tokenizers.py trains, with the
templates' special tokens added), and a second folder with the template in tokenizer_config.json's
"chat_template" (the older layout). Every conversation of a varied set (system prompts, several
turns, accented Latin, CJK, emoji, code, whitespace runs, empty content; tool schemas, a tool call
and its answer) that transformers renders without a template error is given to `TOOL FOLDER --chat-text` and `TOOL FOLDER --chat`: the text
and the ids must equal apply_chat_template's (tokenize=False and the ids of tokenize=True).

Exit 0 when all agree, 1 with the first difference otherwise, 77 (skipped) without transformers.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import transformers  # noqa: F401
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast
except ImportError as error:
    print(f"skipped: the bench environment (bench/setup-python) is needed ({error})")
    sys.exit(77)

import make_tokenizers  # noqa: E402

# Special tokens the templates write, added to the trained tokenizer so each is one id, as in the
# models' own tokenizers.
TEMPLATE_SPECIAL_TOKENS = [
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|im_start|>", "<|im_end|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<|start|>", "<|message|>", "<|channel|>", "<|return|>",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>",
    "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<s>", "</s>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Réponds en français, s'il te plaît."},
     {"role": "user", "content": "Où est la gare ? 数据并行训练 🙂"},
     {"role": "assistant", "content": "Tout droit, puis à gauche. 東京 🚀"},
     {"role": "user", "content": "Merci !"},
     {"role": "assistant", "content": "De rien."}],
    [{"role": "user", "content": "Write a loop.\n\n```python\nfor i in range(3):\n    print(i)\n```"},
     {"role": "assistant", "content": "  Here:\n\tfor (int i = 0; i < 3; ++i) {}\n\n\n  "}],
    [{"role": "user", "content": "   leading and trailing   "},
     {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three"}, {"role": "assistant", "content": "four"},
     {"role": "user", "content": "five"}, {"role": "assistant", "content": "six"}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
TOOL_CALL = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "id": "call0",
                     "function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Zürich"}}}]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call0", "content": "{\"temperature\": 21}"},
    {"role": "assistant", "content": "21 °C."},
]

# Where minja's Jinja differs from Python's, on tool schemas only; these cases are reported, not
# compared (docs/data.md lists them):
# - Hermes: a parameter without a description, `param_fields.description|trim`: Python's undefined
#   prints as "", minja's as "None".
# - functionary v3.1: `"..."|safe + text`: markupsafe HTML-escapes the text added to a safe string,
#   minja has no safe strings.
KNOWN_TOOL_DIFFERENCES = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "an undefined field piped to |trim prints None",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "an undefined field piped to |trim prints None",
    "meetkai-functionary-medium-v3.1.jinja": "text added to a |safe string is not HTML-escaped",
}

# (messages, tools): every conversation without tools, then two with them.
CASES = [(messages, None) for messages in CONVERSATIONS] + [(CONVERSATIONS[1], TOOLS), (TOOL_CALL, TOOLS)]


def trained_tokenizer(workdir):
    make_tokenizers.train(workdir, 2000, 600)
    tokenizer = Tokenizer.from_file(os.path.join(workdir, "bpe", "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TEMPLATE_SPECIAL_TOKENS])
    return tokenizer


def write_folders(tokenizer, template, workdir, name):
    """The folder transformers writes (chat_template.jinja), and the older tokenizer_config.json layout."""
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=make_tokenizers.BOS,
                                   eos_token=make_tokenizers.EOT, unk_token="<s>", pad_token="<|end_of_text|>")
    fast.chat_template = template
    new_layout = os.path.join(workdir, name)
    fast.save_pretrained(new_layout)
    if not os.path.exists(os.path.join(new_layout, "chat_template.jinja")):
        raise SystemExit(f"transformers {transformers.__version__} did not write chat_template.jinja")
    old_layout = new_layout + "-config"
    fast.save_pretrained(old_layout)
    with open(os.path.join(old_layout, "chat_template.jinja")) as f:
        source = f.read()
    os.remove(os.path.join(old_layout, "chat_template.jinja"))
    config_path = os.path.join(old_layout, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = source
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return fast, [new_layout, old_layout]


def run_tool(tool, folder, flag, lines):
    result = subprocess.run([tool, folder, flag], input="".join(lines), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{tool} {folder} {flag} failed: {result.stderr.strip()}")
    return result.stdout.splitlines()


def main():
    tool, templates_dir = sys.argv[1], sys.argv[2]
    names = sorted(n for n in os.listdir(templates_dir) if n.endswith(".jinja"))
    if not names:
        raise SystemExit(f"no .jinja templates in {templates_dir} (scripts/setup unpacks them)")
    failures, known = [], []
    checked = 0
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = trained_tokenizer(workdir)
        for name in names:
            with open(os.path.join(templates_dir, name)) as f:
                template = f.read()
            fast, folders = write_folders(tokenizer, template, workdir, name[:-len(".jinja")])
            lines, texts, ids = [], [], []
            refusal = None
            for messages, tools in CASES:
                if tools is not None and name in KNOWN_TOOL_DIFFERENCES:
                    known.append(f"{name} with tools: {KNOWN_TOOL_DIFFERENCES[name]}")
                    continue
                try:
                    text = fast.apply_chat_template(messages, tools=tools, tokenize=False)
                except Exception as error:  # the template refuses this case (roles, order, variables)
                    refusal = refusal or repr(error)
                    continue
                encoded = fast.apply_chat_template(messages, tools=tools, tokenize=True)
                encoded = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
                record = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                texts.append(text)
                ids.append(list(encoded))
            if not lines:
                print(f"{name}: skipped, transformers renders none of the cases ({refusal})")
                continue
            for folder in folders:
                try:
                    got_texts = [json.loads(line) for line in run_tool(tool, folder, "--chat-text", lines)]
                    got_ids = [json.loads(line) for line in run_tool(tool, folder, "--chat", lines)]
                except RuntimeError as error:
                    failures.append(f"{name}: {error}")
                    break
                for i, (want_text, got_text) in enumerate(zip(texts, got_texts)):
                    if want_text != got_text:
                        failures.append(f"{name} ({os.path.basename(folder)}), conversation {i}: text differs\n"
                                        f"  transformers: {want_text!r}\n  meshtorch:    {got_text!r}")
                        break
                else:
                    if got_ids != ids:
                        failures.append(f"{name} ({os.path.basename(folder)}): ids differ")
            checked += 1
            print(f"{name}: {len(lines)} conversation(s), text and ids {'differ' if failures and failures[-1].startswith(name) else 'equal'}")
    print(f"{checked} of {len(names)} template(s) checked in 2 folder layouts each; {len(failures)} difference(s)")
    for note in sorted(set(known)):
        print("known difference, not compared:", note)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
