#!/usr/bin/python3
"""An independent LLaMA forward in python3-torch (Debian), used as an oracle for Meridian's libtorch model.

Reads config.json, the weights and a token batch that the C++ test wrote as safetensors (parsed here
with json + struct, not with Meridian's code), computes logits and the mean cross-entropy loss and its
gradients with the Hugging Face formulation, and compares them with the C++ results.
  llama_oracle.py CONFIG WEIGHTS INPUTS CPP_OUTPUTS
Prints the relative errors; exits 1 if logits differ by more than 1e-4 or any gradient by more than 1e-4
(max |a - b| / max |b|).
"""
import json
import struct
import sys

import torch


def read_safetensors(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    out = {}
    kinds = {"F32": torch.float32, "I64": torch.int64}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, en = e["data_offsets"]
        raw = bytearray(blob[8 + n + b:8 + n + en])
        t = torch.frombuffer(raw, dtype=kinds[e["dtype"]]) if raw else torch.empty(0, dtype=kinds[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def forward(cfg, w, tokens):
    d, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = d // nh
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    b, s = tokens.shape
    x = torch.nn.functional.embedding(tokens, w["model.embed_tokens.weight"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, s, nh, hd).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(2, 3) / hd ** 0.5 + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.T


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def main():
    cfg = json.load(open(sys.argv[1]))
    weights = {k: v.requires_grad_(True) for k, v in read_safetensors(sys.argv[2]).items()}
    batch = read_safetensors(sys.argv[3])
    cpp = read_safetensors(sys.argv[4])
    tokens, targets = batch["inputs"], batch["targets"]
    logits = forward(cfg, weights, tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    worst = rel(cpp["logits"], logits.detach())
    print(f"logits relative error {worst:.3g}")
    ok = worst <= 1e-4
    print(f"loss python {loss.item():.7f} c++ {cpp['loss'].item():.7f}")
    ok &= abs(loss.item() - cpp["loss"].item()) <= 1e-4 * abs(loss.item())
    for name, p in weights.items():
        e = rel(cpp["grad." + name], p.grad)
        print(f"grad {name} relative error {e:.3g}")
        ok &= e <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
