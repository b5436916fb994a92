"""Tokenizer throughput: meshtorch's byte-level BPE against HF `tokenizers` (Rust) on the same
tokenizer.json and the same corpus, on the same number of threads. A benchmark, never a test: it
prints the figures and the ratio and fails only when the two disagree on the token count.

    bench/.venv/bin/python bench/tokenizer_throughput.py [--tool build/bin/meshtorch-tokenize]
        [--threads 2] [--megabytes 20] [--vocab 32000] [--repeats 3]

The corpus comes from tests/data/make_tokenizers.py's generator (English-like words, accented
Latin, CJK, emoji, numbers, code), one document a line; the tokenizer is trained on part of it
with Llama 3's pre-tokenizer. Both sides are timed on encoding alone (ours: meshtorch-tokenize
--benchmark, which reads every line first; HF: encode_batch_fast, which skips offsets and is the
faster of HF's batch calls, with RAYON_NUM_THREADS set), best of --repeats runs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
sys.path.insert(0, os.path.join(root, "tests", "data"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(root, "build", "bin", "meshtorch-tokenize"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--megabytes", type=float, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # The Rust thread pool reads this when it starts, so before tokenizers is imported.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import make_tokenizers as corpus_source
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    with tempfile.TemporaryDirectory() as tmp:
        lines, size, seed = [], 0, 10
        while size < args.megabytes * 1e6:
            for text in corpus_source.training_texts(count=5000, seed=seed):
                line = text.replace("\n", " ")
                lines.append(line)
                size += len(line.encode()) + 1
            seed += 1
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("\n".join(lines) + "\n")

        tokenizer = Tokenizer(models.BPE(ignore_merges=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(corpus_source.LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[corpus_source.BOS, corpus_source.EOS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator(lines[:20000], trainer)
        folder = os.path.join(tmp, "model")
        os.makedirs(folder)
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
        vocab = tokenizer.get_vocab_size()

        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        theirs, their_tokens = [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            encodings = encode(lines, add_special_tokens=False)
            theirs.append(time.perf_counter() - start)
            their_tokens = sum(len(e.ids) for e in encodings)

        ours, our_tokens = [], 0
        for _ in range(args.repeats):
            with open(corpus) as stdin:
                out = subprocess.run([args.tool, folder, "--benchmark", "-t", str(args.threads)], stdin=stdin,
                                     capture_output=True, text=True, check=True)
            record = json.loads(out.stdout)
            ours.append(record["seconds"])
            our_tokens = record["tokens"]

    mb = size / 1e6
    best_ours, best_theirs = min(ours), min(theirs)
    print(f"corpus: {mb:.1f} MB, {len(lines)} lines; tokenizer: byte-level BPE, Llama 3 pre-tokenizer, "
          f"{vocab} tokens; {args.threads} threads; best of {args.repeats}")
    print(f"meshtorch:        {best_ours:7.3f} s  {mb / best_ours:7.1f} MB/s  {our_tokens} tokens")
    print(f"HF tokenizers:    {best_theirs:7.3f} s  {mb / best_theirs:7.1f} MB/s  {their_tokens} tokens "
          f"({encode.__name__})")
    print(f"ratio (meshtorch throughput / HF's): {best_theirs / best_ours:.2f}")
    if our_tokens != their_tokens:
        print(f"token counts differ: {our_tokens} vs {their_tokens}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
