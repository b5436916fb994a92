"""Greedy generation against transformers' generate(do_sample=False) on a folder transformers wrote
(make_transformers_folder.py, tiny, random weights): meshtorch-generate --ids gives the same new
tokens, token for token, for prompts of different lengths, one at a time and as one left-padded
batch; sampling with a seed gives the same tokens again, and other tokens with another seed; and
a text prompt, through the folder's tokenizer (the byte-level BPE fixture of tests/data), gives
the text transformers' tokenizer decodes from its own greedy tokens.

    python generate_parity.py MESHTORCH_GENERATE MAKE_FOLDER_PY FAMILY [--new-tokens 48]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "fixtures", "bpe")


def ours(generate, folder, prompts, *flags):
    text = "".join(json.dumps(p) + "\n" for p in prompts)
    proc = subprocess.run([generate, folder, "--ids", "--threads", "1", *flags], input=text, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"meshtorch-generate failed ({proc.returncode}):\n{proc.stderr}")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(prompts), proc.stdout
    return rows


def theirs(model, prompts, new_tokens, eos):
    """transformers' greedy new tokens per prompt, as one left-padded batch."""
    longest = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             pad_token_id=pad)
    rows = []
    for row in out[:, longest:].tolist():
        # After a row's eos, transformers pads; the new tokens end with the eos.
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("generate")
    parser.add_argument("make_folder")
    parser.add_argument("family")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        # The vocabulary covers the tokenizer fixture's 600 tokens and its added ones.
        subprocess.run([sys.executable, args.make_folder, folder, "--family", args.family, "--vocab-size", "640"],
                       check=True, capture_output=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(FIXTURE, name), folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        eos = model.generation_config.eos_token_id
        generator = torch.Generator().manual_seed(5)
        # Token ids from 3 up: the random model's eos (2 for a Llama) may still come out, and then
        # both sides must stop there.
        prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 1, 9)]
        failures = []
        for i, prompt in enumerate(prompts):
            mine = ours(args.generate, folder, [prompt], "--max-new-tokens", str(args.new_tokens))[0]
            hf = theirs(model, [prompt], args.new_tokens, eos)[0]
            print(f"prompt {i} ({len(prompt)} tokens) alone: {len(mine)} new tokens, {'equal' if mine == hf else 'DIFFER'}")
            if mine != hf:
                failures.append(f"prompt {i} alone:\n  ours {mine}\n  HF   {hf}")
        mine = ours(args.generate, folder, prompts, "--max-new-tokens", str(args.new_tokens))
        hf = theirs(model, prompts, args.new_tokens, eos)
        for i, (a, b) in enumerate(zip(mine, hf)):
            print(f"prompt {i} in the batch of {len(prompts)}: {'equal' if a == b else 'DIFFER'}")
            if a != b:
                failures.append(f"prompt {i} in the batch:\n  ours {a}\n  HF   {b}")
        sampling = ["--max-new-tokens", "24", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95"]
        first = ours(args.generate, folder, prompts, *sampling, "--seed", "3")
        again = ours(args.generate, folder, prompts, *sampling, "--seed", "3")
        other = ours(args.generate, folder, prompts, *sampling, "--seed", "4")
        if first != again:
            failures.append(f"sampling with seed 3 twice gave different tokens:\n  {first}\n  {again}")
        if first == other:
            failures.append("sampling with seeds 3 and 4 gave the same tokens")
        print(f"sampling: seed 3 twice {'equal' if first == again else 'DIFFER'}, seed 4 "
              f"{'differs' if first != other else 'EQUAL'}")
        # Text in, text out, through each side's tokenizer.
        prompt = "The quick brown fox"
        proc = subprocess.run([args.generate, folder, "--threads", "1", "--prompt", prompt, "--max-new-tokens", "20"],
                              capture_output=True, text=True, errors="backslashreplace", timeout=300)
        if proc.returncode != 0:
            sys.exit(f"meshtorch-generate --prompt failed ({proc.returncode}):\n{proc.stderr}")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt_ids = tokenizer(prompt).input_ids
        new = theirs(model, [prompt_ids], 20, eos)[0]
        if eos is not None and new and new[-1] == eos:
            new = new[:-1]
        expected = tokenizer.decode(new)
        got = proc.stdout[:-1] if proc.stdout.endswith("\n") else proc.stdout
        print(f"text: {'equal' if got == expected else 'DIFFER'} ({len(new)} tokens, prompt ids {prompt_ids})")
        if got != expected:
            failures.append(f"text of {prompt!r}:\n  ours {got!r}\n  HF   {expected!r}")
        if failures:
            sys.exit("FAILED:\n" + "\n".join(failures))
        print("ok")


if __name__ == "__main__":
    main()
