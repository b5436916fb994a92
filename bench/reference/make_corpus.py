"""Writes a deterministic English-like text file for the benchmarks, so that our binary and the
Python reference read the same bytes without anything being downloaded.

    python3 make_corpus.py OUT_FILE [--mb 4] [--seed 0]

Uses only the standard library (it runs before or without the bench environment).
"""

import argparse
import os
import random

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "model train step loss batch data gradient layer token sequence weight memory device rank "
    "shard mesh tensor parallel node process group reduce gather scatter optimizer schedule "
    "learning rate warm cosine epoch checkpoint resume attention head norm embedding vocabulary "
    "river mountain window garden kitchen letter morning evening winter summer city village "
    "quickly slowly carefully always never often again together almost already"
).split()


def sentence(rng):
    n = rng.randint(5, 18)
    words = [rng.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    if rng.random() < 0.15:
        words.insert(rng.randint(1, n - 1), str(rng.randint(2, 4096)))
    return " ".join(words) + rng.choice(".....?!")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    target = int(args.mb * 1024 * 1024)
    tmp = args.out + ".tmp"
    size = 0
    with open(tmp, "w", encoding="ascii") as fp:
        while size < target:
            paragraph = " ".join(sentence(rng) for _ in range(rng.randint(2, 8))) + "\n\n"
            fp.write(paragraph)
            size += len(paragraph)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
