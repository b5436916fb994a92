"""Data start-up: how long a training start waits for its data, first (tokenise into the token
cache) and later (map the cache), beside the time to read the file and beside the Python stack
(HF `tokenizers`' encode_batch_fast over the same documents, reading and splitting included, as a
`datasets` map would tokenise them). A benchmark, never a test: it prints the figures and the
ratios and fails only when the two sides disagree on the token count.

    bench/.venv/bin/python bench/data_startup.py [--megabytes 1024] [--threads 2] [--repeats 2]
        [--tool build/bin/meshtorch-tokenize] [--keep DIR]

The corpus is a text file of documents separated by blank lines from tests/data/make_tokenizers.py's
generator (English-like words, accented Latin, CJK, emoji, numbers, code); the tokenizer is a
32000-token byte-level BPE with Llama 3's pre-tokenizer trained on part of it. Ours is
`meshtorch-tokenize --prepare`, the same code a training start runs. The file is read from the page
cache (written just before): the read time is the machine's memory bandwidth, not a disk's.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
sys.path.insert(0, os.path.join(root, "tests", "data"))


def write_corpus(path, megabytes):
    """Documents separated by blank lines; a 32 MB generated block repeated to the size asked for
    (the generator makes ~10 MB/s, and BPE's word cache sees repeats on both sides alike)."""
    import make_tokenizers as source
    block, size, seed = [], 0, 10
    while size < min(megabytes, 32) * 1e6:
        for text in source.training_texts(count=5000, seed=seed):
            block.append(text.strip("\n"))
            size += len(text.encode()) + 2
        seed += 1
    block_text = "\n\n".join(block) + "\n\n"
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            f.write(block_text)
            written += len(block_text.encode())
    return block, written


def train_tokenizer(folder, texts):
    import make_tokenizers as source
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(source.LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=[source.BOS, source.EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts[:20000], trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": source.BOS, "eos_token": source.EOS}, f)
    return tokenizer


def read_seconds(path):
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - start


def ours(tool, folder, corpus, threads):
    start = time.perf_counter()
    out = subprocess.run([tool, folder, "--prepare", corpus, "-t", str(threads)], capture_output=True, text=True,
                         check=True)
    record = json.loads(out.stdout)
    record["process_seconds"] = time.perf_counter() - start
    return record


def python_stack(tokenizer, corpus, megabytes):
    """The first `megabytes` of the file: read, split into documents, encode in batches of 10,000
    (datasets.map's default is 1,000; larger batches only help HF), framed as <bos> ids <eos>."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    start = time.perf_counter()
    with open(corpus) as f:
        text = f.read(int(megabytes * 1e6))
    text = text[:text.rfind("\n\n")]  # whole documents only
    documents = [d for d in (d.strip("\n") for d in text.split("\n\n")) if d]
    tokens = 0
    for i in range(0, len(documents), 10000):
        tokens += sum(len(e.ids) + 2 for e in encode(documents[i:i + 10000], add_special_tokens=False))
    return time.perf_counter() - start, len(text.encode()), tokens, len(documents)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(root, "build", "bin", "meshtorch-tokenize"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--megabytes", type=float, default=1024)
    parser.add_argument("--python-megabytes", type=float, default=64,
                        help="the Python side encodes this prefix of the corpus (HF's BPE is slow enough that the "
                             "whole file would take most of an hour); compared as throughput")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ.pop("MESHTORCH_DATA_CACHE", None)

    work = args.keep or tempfile.mkdtemp(prefix="meshtorch-data-startup-")
    try:
        corpus = os.path.join(work, "corpus", "corpus.txt")
        os.makedirs(os.path.dirname(corpus), exist_ok=True)
        block, size = write_corpus(corpus, args.megabytes)
        tokenizer = train_tokenizer(os.path.join(work, "model"), block)
        folder = os.path.join(work, "model")
        cache = os.path.join(work, "corpus", ".meshtorch-cache")

        no_tokenizer = os.path.join(work, "bytes")
        os.makedirs(no_tokenizer, exist_ok=True)
        reads = [read_seconds(corpus) for _ in range(max(args.repeats, 3))]
        firsts, cached, byte_firsts = [], [], []
        for _ in range(args.repeats):
            shutil.rmtree(cache, ignore_errors=True)
            first = ours(args.tool, folder, corpus, args.threads)
            assert first["written"], first
            firsts.append(first)
            again = ours(args.tool, folder, corpus, args.threads)
            assert not again["written"], again
            cached.append(again)
            byte_firsts.append(ours(args.tool, no_tokenizer, corpus, args.threads))
        theirs = [python_stack(tokenizer, corpus, args.python_megabytes) for _ in range(args.repeats)]
        prefix = os.path.join(work, "prefix")
        os.makedirs(prefix, exist_ok=True)
        with open(corpus) as f:
            text = f.read(int(args.python_megabytes * 1e6))
        with open(os.path.join(prefix, "prefix.txt"), "w") as f:
            f.write(text[:text.rfind("\n\n")] + "\n")
        prefix_counts = ours(args.tool, folder, os.path.join(prefix, "prefix.txt"), args.threads)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    mb = size / 1e6
    read = min(reads)
    first = min(firsts, key=lambda r: r["seconds"])
    again = min(cached, key=lambda r: r["process_seconds"])
    byte_first = min(byte_firsts, key=lambda r: r["seconds"])
    their_seconds, their_bytes, their_tokens, their_documents = min(theirs)
    ours_rate, their_rate = mb / first["seconds"], their_bytes / 1e6 / their_seconds
    print(f"corpus: {mb:.0f} MB of text, {first['documents']} documents, {first['tokens']} tokens; byte-level BPE "
          f"(32000, Llama 3 pre-tokenizer); {args.threads} threads; best of {args.repeats}")
    print(f"read the file (page cache):            {read:8.2f} s")
    print(f"meshtorch, first start, BPE:           {first['seconds']:8.2f} s  = {first['seconds'] / read:6.1f} x the read"
          f"  ({ours_rate:.1f} MB/s)")
    print(f"meshtorch, first start, byte tokenizer:{byte_first['seconds']:8.2f} s  = "
          f"{byte_first['seconds'] / read:6.1f} x the read")
    print(f"meshtorch, later start (cache):        {again['seconds']:8.3f} s  (whole process "
          f"{again['process_seconds']:.3f} s)")
    print(f"HF tokenizers, read + encode {their_bytes / 1e6:.0f} MB:  {their_seconds:8.2f} s  ({their_rate:.1f} MB/s)")
    print(f"ratio (meshtorch's MB/s / HF's): {ours_rate / their_rate:.2f}")
    if (their_tokens, their_documents) != (prefix_counts["tokens"], prefix_counts["documents"]):
        print(f"counts differ on the first {args.python_megabytes} MB: {prefix_counts['tokens']} tokens in "
              f"{prefix_counts['documents']} documents vs HF's {their_tokens} in {their_documents}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
