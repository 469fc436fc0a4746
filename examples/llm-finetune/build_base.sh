#!/usr/bin/env bash
# Builds the small base model that examples/llm-finetune/finetune.yaml fine-tunes, from text on this
# machine (Debian's license texts, /usr/share/common-licenses), with Meridian itself:
#   1. the task data (make_data.py) and a SentencePiece tokenizer (`meridian tokenizer train`),
#   2. a LLaMA-architecture config.json sized for it (d_model 256, 4 layers, 8 heads / 4 KV heads),
#   3. brief pre-training on the text (`meridian train-local`), which writes an HF model directory.
# usage: build_base.sh [WORK_DIR] [PRETRAIN_STEPS]   (defaults: examples/llm-finetune/work, 150)
# Needs a build (scripts/build.sh). Takes about a minute on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="${1:-$here/work}"
steps="${2:-150}"
bin="${MERIDIAN_BIN:-$root/build/bin}"
mkdir -p "$work/base-init"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# The text: every license text Debian ships (symlinks resolved, each once).
find /usr/share/common-licenses -maxdepth 1 -type f -o -maxdepth 1 -type l | xargs -n1 readlink -f | sort -u \
  | xargs cat > "$work/corpus.txt"
python3 "$here/make_data.py" "$work/opposites.jsonl" --words "$work/words.txt"
"$bin/meridian" tokenizer train --input "$work/corpus.txt" --input "$work/words.txt" --vocab-size 2000 \
  --out "$work/base-init" 2>/dev/null
cat > "$work/base-init/config.json" <<JSON
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 2048,
  "hidden_size": 256,
  "intermediate_size": 704,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "torch_dtype": "float32"
}
JSON
cat > "$work/pretrain.yaml" <<YAML
# Written by build_base.sh: pre-training on plain text (loss on every token).
job:
  model: base-init
  data: corpus.txt
  steps: $steps
  global_batch: 16
  micro_batches: 1
  sequence_length: 64
  seed: 11
  optimizer: {name: adamw, lr: 3e-3, weight_decay: 0.01, warmup_steps: 10, min_lr_ratio: 0.1, grad_clip: 1.0}
YAML
echo "pre-training the base model for $steps steps on $(wc -c < "$work/corpus.txt") bytes of text"
"$bin/meridian" train-local "$work/pretrain.yaml" --out "$work/base" \
  | awk 'NR == 1 || NR % 25 == 0 {print "  " $0; fflush()}'
echo "wrote $work/base (config.json, model.safetensors, tokenizer.model)"
