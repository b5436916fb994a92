"""Writes a model folder the way transformers itself does: a random tiny Llama (grouped-query
attention, head_dim not hidden_size / heads, llama3 rope scaling whose frequencies fall in all three
bands, rope_theta not 10000) saved with save_pretrained into sharded safetensors.

    python make_transformers_folder.py OUT [--legacy-config] [--size tiny|400mb] [--family F]

--family mistral, qwen2 or qwen3 writes the same shapes as that family's model (MistralForCausalLM
with a sliding_window of 256, longer than the sequences the checks use; Qwen2ForCausalLM, whose q,
k and v biases then hold random values; Qwen3ForCausalLM, whose q_norm and k_norm do too).

With --legacy-config, config.json is then rewritten in the earlier generation's fields (top-level
rope_theta and rope_scaling, torch_dtype), which transformers still reads to the same model.
--size 400mb writes a model of 201M parameters in bf16 (about 400 MB in five files of at most
100 MB, with an index), for measuring how much memory loading takes.
"""
import argparse
import json
import os

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 256}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False}),
}


SIZES = {
    "tiny": {"config": dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=24, dtype="float32"),
             "shard": "100KB"},
    "400mb": {"config": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=64, dtype="bfloat16"),
              "shard": "100MB"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--legacy-config", action="store_true")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--vocab-size", type=int, help="the vocabulary's size instead of the size's own")
    args = parser.parse_args()

    torch.manual_seed(0)
    config_class, model_class, family_fields = FAMILIES[args.family]
    config = config_class(
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        **family_fields, **{**SIZES[args.size]["config"], **({"vocab_size": args.vocab_size} if args.vocab_size else {})})
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so a weight read into the wrong norm shows
            p.add_(torch.randn_like(p) * 0.05)
    model = model.to(getattr(torch, SIZES[args.size]["config"]["dtype"]))  # the files' dtype
    model.save_pretrained(args.out, max_shard_size=SIZES[args.size]["shard"])
    written = json.load(open(os.path.join(args.out, "config.json")))
    assert "rope_parameters" in written and "rope_theta" not in written, written
    shards = [f for f in os.listdir(args.out) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(args.out, "model.safetensors.index.json")), shards

    if args.legacy_config:
        rope = written.pop("rope_parameters")
        written["rope_theta"] = rope.pop("rope_theta")
        written["rope_scaling"] = rope
        written["torch_dtype"] = written.pop("dtype")
        written["transformers_version"] = "4.46.0"
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(written, f, indent=2)
        assert config_class.from_pretrained(args.out).rope_parameters == config.rope_parameters
    print(f"{args.out}: {args.family}, {len(shards)} safetensors shards, "
          f"config.json {'legacy' if args.legacy_config else 'transformers 5'}")


if __name__ == "__main__":
    main()
