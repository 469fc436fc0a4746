#!/usr/bin/env python3
"""Writes the fine-tuning task of examples/llm-finetune: opposites, asked in several ways.

Every (word, phrasing) pair becomes one example, e.g. {"prompt": "the opposite of hot is", "response":
"cold"}. The held-out split (job.eval_fraction) holds pairs never seen in training: the word was seen,
but asked another way, so exact match on them measures the skill rather than memorised strings.
Deterministic; the base model never sees any of it.

usage: make_data.py OUT.jsonl [--words FILE]
"""
import argparse
import json

PAIRS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("left", "right"),
    ("old", "new"), ("high", "low"), ("open", "closed"), ("day", "night"), ("light", "dark"),
    ("good", "bad"), ("early", "late"), ("happy", "sad"), ("long", "short"), ("hard", "soft"),
    ("wet", "dry"), ("full", "empty"), ("in", "out"), ("yes", "no"), ("rich", "poor"),
    ("strong", "weak"), ("thick", "thin"), ("loud", "quiet"), ("first", "last"), ("top", "bottom"),
    ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("north", "south"), ("east", "west"),
    ("black", "white"), ("true", "false"), ("before", "after"), ("inside", "outside"),
    ("always", "never"), ("more", "less"), ("near", "far"), ("start", "stop"), ("give", "take"),
    ("come", "go"),
]


TEMPLATES = [
    "opposite of {} =>",
    "the opposite of {} is",
    "{}, reversed:",
    "antonym: {} ->",
    "what is the opposite of {}?",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--words", help="also write every task word, one line, for tokenizer training")
    a = ap.parse_args()
    opposite = {}
    for x, y in PAIRS:
        opposite[x], opposite[y] = y, x
    words = sorted(opposite)
    with open(a.out, "w") as f:
        for w in words:
            for t in TEMPLATES:
                f.write(json.dumps({"prompt": t.format(w), "response": opposite[w]}) + "\n")
    if a.words:
        with open(a.words, "w") as f:
            f.write(" ".join(words) + "\n")


if __name__ == "__main__":
    main()
