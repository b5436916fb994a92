"""Model parity with transformers: loads a checkpoint folder written by our binaries (HF
config.json + model.safetensors under HF names) with the class its config names (AutoModelForCausalLM:
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM), computes HF's loss on the token batch
given in a JSON file, and compares it with the loss we computed on the same batch.

    python hf_loss.py CHECKPOINT_DIR OURS_JSON [--tol 1e-5] [--family llama|mistral|qwen2|qwen3]

OURS_JSON is {"tokens": [[...], ...], "loss": x} (a batch of equal-length rows; labels are the
tokens, shifted inside the model as in training), optionally with "token_losses": [[...]], each
position's next-token loss (rows one shorter than the tokens), which is compared too: a mean can
hide a difference that single positions show. Exits 0 when every |HF - ours| <= tol, 1 when one
is larger or the folder does not load cleanly (a missing, unexpected or mis-shaped weight: HF would
otherwise initialise it at random and only warn), 2 on bad input. Runs in fp32 on the CPU.
"""

import argparse
import json
import math
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="folder with config.json and model.safetensors")
    parser.add_argument("ours", help='JSON file {"tokens": [[...]], "loss": x}')
    parser.add_argument("--tol", type=float, default=1e-5, help="largest allowed |HF loss - our loss|")
    parser.add_argument("--family", help="the model_type the folder must load as (default: any)")
    args = parser.parse_args()

    try:
        with open(args.ours) as fp:
            ours = json.load(fp)
        tokens = torch.tensor(ours["tokens"], dtype=torch.long)
        our_loss = float(ours["loss"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{args.ours}: expected {{\"tokens\": [[...]], \"loss\": x}} ({e})", file=sys.stderr)
        return 2
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        print(f"{args.ours}: tokens must be a batch of rows of at least 2 tokens, got shape {list(tokens.shape)}", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.checkpoint)
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        print(f"{args.ours}: token ids must lie in [0, {config.vocab_size})", file=sys.stderr)
        return 2
    if args.family and config.model_type != args.family:
        print(f"{args.checkpoint} is a '{config.model_type}' model, expected '{args.family}'", file=sys.stderr)
        return 1
    model, info = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, dtype=torch.float32, output_loading_info=True, use_cache=False
    )
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        print(f"{args.checkpoint} does not load cleanly into {type(model).__name__}: {problems}", file=sys.stderr)
        return 1
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
        hf_loss = out.loss.item()
        logits = out.logits[:, :-1].float()
        hf_token_losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(tokens.shape[0], -1).double()

    diff = abs(hf_loss - our_loss)
    ok = math.isfinite(hf_loss) and diff <= args.tol
    result = {"hf_loss": hf_loss, "our_loss": our_loss, "abs_diff": diff}
    if "token_losses" in ours:
        theirs = torch.tensor(ours["token_losses"], dtype=torch.double)
        if theirs.shape != hf_token_losses.shape:
            print(f"{args.ours}: token_losses has shape {list(theirs.shape)}, expected {list(hf_token_losses.shape)}",
                  file=sys.stderr)
            return 2
        token_diff = (theirs - hf_token_losses).abs()
        worst = int(token_diff.argmax())
        result["token_losses_max_abs_diff"] = token_diff.max().item()
        ok = ok and result["token_losses_max_abs_diff"] <= args.tol
    result.update(tol=args.tol, batch=list(tokens.shape), model_class=type(model).__name__,
                  attn_implementation=model.config._attn_implementation, ok=ok)
    print(json.dumps(result))
    if not ok:
        print(f"HF and our losses differ on the same {list(tokens.shape)} batch by more than {args.tol:g}: "
              f"mean {hf_loss:.8f} vs {our_loss:.8f} (|difference| {diff:.3g})", file=sys.stderr)
        if "token_losses_max_abs_diff" in result:
            row, pos = divmod(worst, hf_token_losses.shape[1])
            print(f"worst position: row {row}, predicting token {pos + 1}: HF {hf_token_losses[row, pos].item():.8f} "
                  f"vs ours {theirs[row, pos].item():.8f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
