"""Reference tokenizers for the tokenizer tests, made with the `tokenizers` and `sentencepiece` packages.

  make_tokenizers.py train OUT --bpe-vocab N --sp-vocab N
      OUT/bpe: a byte-level BPE tokenizer.json with Llama 3's pre-tokenizer (its Split regex, then
      ByteLevel without regex, ignore_merges), special and added tokens, and a tokenizer_config.json
      naming <bos>/<eos>; OUT/sentencepiece: a Llama 2 style tokenizer.model (BPE, byte fallback,
      identity normalisation, digits split).
  make_tokenizers.py corpus OUT.jsonl
      The test corpus, one JSON string a line: ASCII, accented Latin, CJK, emoji, code, numbers,
      whitespace runs, newlines, special tokens written in the text.
  make_tokenizers.py expect FOLDER CORPUS.jsonl OUT.jsonl
      Each corpus text's ids from the package that made FOLDER's tokenizer, one JSON array a line.

The fixture in tests/data/fixtures was made with `train` (--bpe-vocab 600 --sp-vocab 600) and
`expect`, and is checked in so that the tests run without Python.
"""
import argparse
import json
import os
import random

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"

WORDS = ("the quick brown fox jumps over lazy dog training model data token layer weight gradient "
         "shard mesh rank tensor parallel distributed checkpoint loss step batch sequence attention "
         "café naïve résumé Straße façade Ångström señor über coöperate élève déjà vu garçon").split()
CJK = ["数据并行训练", "東京は日本の首都です", "모델을 학습합니다", "张量并行", "漢字とひらがな"]
EMOJI = ["🙂", "🚀", "👩‍💻", "🇫🇷", "✨", "🧪"]
CODE = [
    "def train(model, data):\n    for step, batch in enumerate(data):\n        loss = model(batch)\n",
    "int main(int argc, char** argv) {\n\treturn argc > 1 ? 0 : 1;\n}\n",
    "x = [i**2 for i in range(10) if i % 3 == 0]  # squares",
    "if (a != b && c <= d) { std::cout << \"x\" << '\\n'; }",
]


SYLLABLES = ("ka to ri en an ber sch tz ou é ü ñ ça ло ва ни κα λη μέ ing tion ment pre con ter "
             "ly ed er st gh th qu ").split()


def training_texts(count=3000, seed=0):
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(5, 30)):
            r = rng.random()
            if r < 0.2:
                parts.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
            elif r < 0.6:
                word = rng.choice(WORDS)
                parts.append(word.capitalize() if rng.random() < 0.2 else word)
            elif r < 0.7:
                parts.append(str(rng.randint(0, 100000)))
            elif r < 0.78:
                parts.append(rng.choice(CJK))
            elif r < 0.82:
                parts.append(rng.choice(EMOJI))
            elif r < 0.9:
                parts.append(rng.choice(["don't", "it's", "we'll", "they're", "I'm", "you've", "he'd"]))
            else:
                parts.append(rng.choice([",", ".", "!", "?", ";", ":", "(", ")", "\"", "--", "..."]))
        texts.append(" ".join(parts))
    texts += CODE * 20
    return texts


def test_corpus():
    texts = [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "DON'T SHOUT; I'M here, WE'LL see, they'RE fine, it's OK",
        "café naïve résumé Straße façade Ångström señor über élève déjà",
        "数据并行训练 東京は日本の首都です 모델을 학습합니다",
        "emoji 🙂🚀 and 👩‍💻 with flags 🇫🇷🇩🇪 ✨",
        "numbers 0 7 42 123 1234 12345678 3.14159 -2e10 1,000,000",
        "whitespace  runs   of    spaces\t\ttabs and\n\nnewlines\r\nand  \n  mixed   ",
        "    leading spaces",
        "trailing spaces    ",
        "\n\n\nonly newlines first",
        " ",
        "",
        "a",
        BOS + "text between" + EOS + " special tokens " + EOT,
        "special tokens in text: " + BOS + BOS + " twice, " + EOT + "glued" + EOT,
        "mask with lstrip:   <mask> and added NOTE: here, and <|begin_of_text",
        "<|end_of_text|><|begin_of_text|>",
        "unknown letters ŋ ʃ ʒ Ω ж and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "".join(CODE),
        "x" * 300 + " " + "ab" * 200,
        " " * 50 + "x" + "\t" * 10 + "\n" * 5,
        "mixed123abc456def 7a8b9c",
        "https://example.com/path?query=1&b=2#frag",
        "email@example.org, @user #hashtag $100 50% ^caret~tilde`tick`",
    ]
    texts += training_texts(count=60, seed=1)
    return texts


def train(out, bpe_vocab, sp_vocab):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    import sentencepiece as spm

    texts = training_texts()
    bpe_dir = os.path.join(out, "bpe")
    os.makedirs(bpe_dir, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=[BOS, EOS, EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken("NOTE:", special=False)])
    tokenizer.save(os.path.join(bpe_dir, "tokenizer.json"))
    with open(os.path.join(bpe_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)

    sp_dir = os.path.join(out, "sentencepiece")
    os.makedirs(sp_dir, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(t.replace("\n", " ") for t in texts), model_prefix=os.path.join(sp_dir, "tokenizer"),
        vocab_size=sp_vocab, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        character_coverage=0.9995, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        user_defined_symbols=["<sep>"], minloglevel=2)
    os.remove(os.path.join(sp_dir, "tokenizer.vocab"))


def expect(folder, corpus, out):
    with open(corpus) as f:
        texts = [json.loads(line) for line in f]
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    else:
        import sentencepiece as spm
        processor = spm.SentencePieceProcessor(model_file=os.path.join(folder, "tokenizer.model"))
        ids = [processor.encode(t) for t in texts]
    with open(out, "w") as f:
        for row in ids:
            f.write(json.dumps(row) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train")
    p.add_argument("out")
    p.add_argument("--bpe-vocab", type=int, default=2000)
    p.add_argument("--sp-vocab", type=int, default=2000)
    p = sub.add_parser("corpus")
    p.add_argument("out")
    p = sub.add_parser("expect")
    p.add_argument("folder")
    p.add_argument("corpus")
    p.add_argument("out")
    args = parser.parse_args()
    if args.command == "train":
        train(args.out, args.bpe_vocab, args.sp_vocab)
    elif args.command == "corpus":
        with open(args.out, "w") as f:
            for text in test_corpus():
                f.write(json.dumps(text, ensure_ascii=False) + "\n")
    else:
        expect(args.folder, args.corpus, args.out)


if __name__ == "__main__":
    main()
