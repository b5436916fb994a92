"""transformers' generate (eager, with its own KV cache) on a model folder, timed: the reference of
bench/run's generate section. Greedy, exactly --new-tokens tokens per prompt (min_new_tokens, as
meshtorch-generate --ignore-eos), prompts of different lengths left-padded into one batch.

    python hf_generate.py FOLDER PROMPTS_JSON --new-tokens 128 [--threads 2] [--reps 3]
    python hf_generate.py --make-folder CONFIG_DIR OUT      (a random model saved as a folder)

Prints one JSON line: the new tokens, the median seconds of --reps timed calls (after one short
warm-up call) and tokens per second.
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def make_folder(config_dir, out):
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters())} parameters")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--make-folder":
        return make_folder(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("prompts", help="JSON file: a list of prompts, each a list of token ids")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = json.load(open(args.prompts))
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    model.eval()
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    def run(new_tokens):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0)

    run(4)  # warm-up
    seconds = []
    for _ in range(args.reps):
        start = time.perf_counter()
        out = run(args.new_tokens)
        seconds.append(time.perf_counter() - start)
    tokens = (out.shape[1] - longest) * len(prompts)
    median = statistics.median(seconds)
    print(json.dumps({"tokens": tokens, "seconds": median, "tokens_per_s": tokens / median, "all_seconds": seconds}))


if __name__ == "__main__":
    main()
