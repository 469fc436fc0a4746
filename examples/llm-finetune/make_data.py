#!/usr/bin/env python3
"""Writes the fine-tuning task of examples/llm-finetune: small transformations of inputs, several kinds.

Each line is {"prompt": ..., "response": ..., "kind": ...}; `meridian eval` and `meridian run` report
held-out exact match per kind. The kinds:

  reverse    "reverse: l a m p =>"         -> "p m a l"
  uppercase  "uppercase: l a m p =>"       -> "L A M P"
  repeat     "repeat twice: lamp =>"       -> "lamp lamp"
  add        "add: 23 + 58 =>"             -> "81"
  date       "date: 2031-07-14 =>"         -> "14 July 2031"

Every input occurs in exactly one example of the file: a word, a pair of numbers or a date is never
used twice, by any kind. So the held-out split (job.eval_fraction, a seeded share of the lines) holds
inputs the model never saw during fine-tuning, and exact match on them measures the skill, not
memorised strings. Words come from the given text (Debian's license texts in build_base.sh): lowercase
words of 3 to 7 letters, each once, then made-up strings of 3 to 7 letters when more are needed. Deterministic for the same text, kinds, count and seed.

usage: make_data.py OUT.jsonl --text CORPUS [--kinds repeat,uppercase,...] [--per-kind N] [--seed S]
(defaults: repeat and uppercase, 20000 each: what the small base learns in the demo's budget; the other
kinds need longer, examples/llm-finetune/README.md has the measurements)
"""
import argparse
import json
import random
import re
import sys

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
KINDS = ["reverse", "uppercase", "repeat", "add", "date"]
WORD_KINDS = {"reverse", "uppercase", "repeat"}


def spaced(word):
    return " ".join(word)


def example(kind, x):
    if kind == "reverse":
        return f"reverse: {spaced(x)} =>", spaced(x[::-1])
    if kind == "uppercase":
        return f"uppercase: {spaced(x)} =>", spaced(x.upper())
    if kind == "repeat":
        return f"repeat twice: {x} =>", f"{x} {x}"
    if kind == "add":
        a, b = x
        return f"add: {a} + {b} =>", str(a + b)
    if kind == "date":
        y, m, d = x
        return f"date: {y:04d}-{m:02d}-{d:02d} =>", f"{d} {MONTHS[m - 1]} {y}"
    raise ValueError(kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--text", required=True, help="text to take the words from")
    ap.add_argument("--kinds", default="repeat,uppercase", help="comma-separated, from: " + ", ".join(KINDS))
    ap.add_argument("--per-kind", type=int, default=20000, help="examples of each kind")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    kinds = list(dict.fromkeys(k for k in a.kinds.split(",") if k))  # each once, in the given order
    if not kinds or a.per_kind < 1:
        sys.exit("make_data.py: --kinds names no kind, or --per-kind is below 1")
    for k in kinds:
        if k not in KINDS:
            sys.exit(f"make_data.py: --kinds: unknown kind '{k}' (known: {', '.join(KINDS)})")
    rng = random.Random(a.seed)
    words = sorted(set(re.findall(r"\b[a-z]{3,7}\b", open(a.text, encoding="utf-8", errors="replace").read())))
    need = a.per_kind * len([k for k in kinds if k in WORD_KINDS])
    seen = set(words)
    while len(words) < need:  # the text's words first, then made-up ones of 3-7 letters
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    rng.shuffle(words)
    pairs = [(x, y) for x in range(100) for y in range(100)]
    rng.shuffle(pairs)
    dates = [(y, m, d) for y in range(1950, 2050) for m in range(1, 13) for d in range(1, 29)]
    rng.shuffle(dates)
    for k, inputs in (("add", pairs), ("date", dates)):
        if k in kinds and a.per_kind > len(inputs):
            sys.exit(f"make_data.py: --per-kind {a.per_kind}: kind '{k}' has {len(inputs)} distinct inputs")
    lines = []
    next_word = 0
    for k in kinds:
        for i in range(a.per_kind):
            if k in WORD_KINDS:
                x = words[next_word]
                next_word += 1
            else:
                x = pairs[i] if k == "add" else dates[i]
            p, r = example(k, x)
            lines.append({"prompt": p, "response": r, "kind": k})
    rng.shuffle(lines)
    with open(a.out, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
