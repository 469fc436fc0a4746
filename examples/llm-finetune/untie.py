#!/usr/bin/env python3
"""Unties a LLaMA model directory's LM head from its embedding, in place.

usage: untie.py MODEL_DIR

A base pre-trained with tied embeddings (`tie_word_embeddings: true`) keeps one matrix for both ends of
the model, so Meridian's executors run the embedding and the head in one stage and no pipeline can cut
the model. This writes the shared matrix out twice, as `model.embed_tokens.weight` and `lm_head.weight`,
and sets `tie_word_embeddings: false` in config.json: the model computes exactly what it did, and
fine-tuning then trains the two copies apart, so the first and the last stage of a pipeline each hold
their own (what Hugging Face's `tie_word_embeddings=False` checkpoints, TinyLlama's among them, look like).

Only the Python standard library: safetensors is an 8-byte little-endian header length, a JSON header
of name -> {dtype, shape, data_offsets}, then the tensors' bytes. A model already untied is left as is.
"""
import json
import os
import struct
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2])
    model = sys.argv[1]
    cfg_path = os.path.join(model, "config.json")
    st_path = os.path.join(model, "model.safetensors")
    cfg = json.load(open(cfg_path))
    if not os.path.exists(st_path):
        sys.exit(f"{st_path}: no such file (untie.py reads one model.safetensors, not a sharded index)")
    with open(st_path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    if "lm_head.weight" in header:
        if cfg.get("tie_word_embeddings", False):
            sys.exit(f"{st_path}: holds lm_head.weight although {cfg_path} says tie_word_embeddings: true")
        print(f"{model}: already untied")
        return
    if not cfg.get("tie_word_embeddings", False):
        sys.exit(f"{st_path}: no lm_head.weight, and {cfg_path} does not say tie_word_embeddings: true")
    emb = header.get("model.embed_tokens.weight")
    if emb is None:
        sys.exit(f"{st_path}: no model.embed_tokens.weight")
    begin, end = emb["data_offsets"]
    if not 0 <= begin <= end <= len(data):
        sys.exit(f"{st_path}: model.embed_tokens.weight's data_offsets [{begin}, {end}] lie outside its "
                 f"{len(data)} bytes of data")
    header["lm_head.weight"] = {"dtype": emb["dtype"], "shape": emb["shape"],
                                "data_offsets": [len(data), len(data) + end - begin]}
    data += data[begin:end]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as the format recommends
    tmp = st_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    os.replace(tmp, st_path)
    cfg["tie_word_embeddings"] = False
    with open(cfg_path + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(cfg_path + ".tmp", cfg_path)
    print(f"{model}: LM head untied from the embedding (lm_head.weight written as a copy of it)")


if __name__ == "__main__":
    main()
