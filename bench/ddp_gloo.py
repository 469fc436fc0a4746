#!/usr/bin/python3
"""The baseline users would pick instead: PyTorch DistributedDataParallel over Gloo, one rank per site.

Trains the same LLaMA-architecture model as Meridian (the forward of tests/llama_oracle.py, an
independent python3-torch implementation, as an nn.Module), from the same initial weights
(MODEL/model.safetensors), on exactly the same data: Meridian's synthetic language, regenerated here
with the same torch generators (SyntheticData::MicroBatch in executor/trainer.cc), so step s sees the
same 48 sequences in both systems. Each rank takes a contiguous third of the step's sequences and
accumulates gradients over --accum micro-batches (DDP's no_sync), then DDP all-reduces once. AdamW,
weight decay on matrices only, warm-up + cosine schedule and global-norm clipping as Meridian's.

Gloo connects ranks directly; --bind makes this rank listen on its site's address, so the traffic
crosses the emulated links (tbf). Started by bench/run_all.py, one process per site namespace.

Prints one JSON line per step on rank 0: {"step", "loss", "seconds"}.
"""
import argparse
import contextlib
import json
import math
import os
import struct
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import llama_oracle  # noqa: E402


def synthetic_micro_batch(seed, vocab, step, micro_batch, mbs, seq):
    """Meridian's SyntheticData::MicroBatch, bit for bit (same ATen generators and ops)."""
    mask = (1 << 64) - 1
    g = torch.Generator().manual_seed((seed * 7919 + 17) & mask)
    successor = torch.randperm(vocab, generator=g, dtype=torch.int64)
    g = torch.Generator().manual_seed((seed ^ ((step * 1000003 + micro_batch * 7919 + 1) & mask)) & mask)
    starts = torch.randint(vocab, (mbs,), generator=g, dtype=torch.int64)
    noise = torch.rand((mbs, seq + 1), generator=g)
    randoms = torch.randint(vocab, (mbs, seq + 1), generator=g, dtype=torch.int64)
    t = torch.empty((mbs, seq + 1), dtype=torch.int64)
    t[:, 0] = starts
    for i in range(1, seq + 1):
        t[:, i] = torch.where(noise[:, i] < 0.9, successor[t[:, i - 1]], randoms[:, i])
    return t


def step_sequences(a, step):
    """The step's global batch as Meridian generates it: micro-batches of --meridian-mbs sequences."""
    m = a.global_batch // a.meridian_mbs
    return torch.cat([synthetic_micro_batch(a.seed, a.vocab_data, step, k, a.meridian_mbs, a.seq) for k in range(m)])


class Llama(torch.nn.Module):
    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.names = sorted(weights)
        self.params = torch.nn.ParameterList([torch.nn.Parameter(weights[n].clone()) for n in self.names])

    def forward(self, tokens):
        return llama_oracle.forward(self.cfg, dict(zip(self.names, self.params)), tokens)


def write_safetensors(path, tensors):
    """float32 tensors -> safetensors (json header + raw little-endian data)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous()
        raw = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def initial_weights(cfg, seed):
    """A LLaMA's HF-named weights: normal(0, 0.02) matrices, ones for RMSNorm weights."""
    d, h, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = d // cfg["num_attention_heads"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (d, d),
                       p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, d), p + "post_attention_layernorm.weight": (d,),
                       p + "mlp.gate_proj.weight": (h, d), p + "mlp.up_proj.weight": (h, d),
                       p + "mlp.down_proj.weight": (d, h)})
    g = torch.Generator().manual_seed(seed)
    return {k: torch.ones(s) if len(s) == 1 else torch.normal(0.0, 0.02, s, generator=g) for k, s in shapes.items()}


def learning_rate(a, step):
    if a.warmup_steps > 0 and step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    decay = max(1, a.total_steps - a.warmup_steps)
    progress = min(1.0, (step - a.warmup_steps) / decay)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def wrap_ddp(model, pg):
    """DistributedDataParallel over `pg`, without its start-up broadcast of every parameter from rank 0: every
    rank loaded the same weights file, so a checksum (two float64s, all-reduced for its minimum and maximum)
    shows they start equal, where the broadcast would move the whole model over the links (137 MB: about 9
    minutes at 2 Mbit/s, before the first step). Ranks that differ fail here. Where this torch has no
    `_sync_module_states` to skip, DDP broadcasts as usual."""
    import torch.nn.parallel.distributed as ddp_module
    with torch.no_grad():
        local = torch.tensor([sum(float(p.double().sum()) for p in model.params),
                              sum(float(p.double().abs().sum()) for p in model.params)], dtype=torch.float64)
    lo, hi = local.clone(), local.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=pg)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=pg)
    if not torch.equal(lo, hi):
        raise SystemExit(f"ddp_gloo: the ranks' initial weights differ (checksums {lo.tolist()} .. {hi.tolist()})")
    sync = getattr(ddp_module, "_sync_module_states", None)
    if sync is None:
        return torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    ddp_module._sync_module_states = lambda **kwargs: None
    try:
        return torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    finally:
        ddp_module._sync_module_states = sync


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    ap.add_argument("--bind", required=True, help="this rank's address for Gloo's connections")
    ap.add_argument("--model", required=True, help="directory with config.json and model.safetensors")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--total-steps", type=int, required=True, help="the schedule's length (the job's steps)")
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per rank per step")
    ap.add_argument("--meridian-mbs", type=int, required=True)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    a.vocab_data = cfg["vocab_size"]
    weights = llama_oracle.read_safetensors(os.path.join(a.model, "model.safetensors"))
    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.world, a.rank == 0, timedelta(seconds=300))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=a.bind)]
    opts._timeout = timedelta(seconds=900)
    pg = dist.ProcessGroupGloo(store, a.rank, a.world, opts)
    model = Llama(cfg, weights)
    ddp = wrap_ddp(model, pg)
    decay = [p for p in model.params if p.dim() >= 2]
    plain = [p for p in model.params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": plain, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    per_rank = a.global_batch // a.world
    mbs = per_rank // a.accum
    total_targets = a.global_batch * a.seq
    for step in range(a.steps):
        t0 = time.time()
        seqs = step_sequences(a, step)[a.rank * per_rank:(a.rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        local = 0.0
        for k in range(a.accum):
            batch = seqs[k * mbs:(k + 1) * mbs]
            inputs, targets = batch[:, :-1], batch[:, 1:]
            # Sum over this rank's tokens / all the step's tokens, times the world size because DDP averages:
            # the all-reduced gradient is the gradient of the step's mean loss, as in Meridian.
            with ddp.no_sync() if k + 1 < a.accum else contextlib.nullcontext():
                logits = ddp(inputs)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                         reduction="sum") / total_targets
                (loss * a.world).backward()
            local += loss.item()
        total = torch.tensor([local])
        dist.all_reduce(total, group=pg)
        torch.nn.utils.clip_grad_norm_(model.params, a.grad_clip)
        for g in opt.param_groups:
            g["lr"] = learning_rate(a, step)
        opt.step()
        if a.rank == 0:
            print(json.dumps({"step": step, "loss": total.item(), "seconds": time.time() - t0}), flush=True)


if __name__ == "__main__":
    main()
