#!/usr/bin/env bash
# Builds the small base model that examples/llm-finetune/finetune.yaml fine-tunes, from text on this
# machine (Debian's license texts, /usr/share/common-licenses), with Meridian itself:
#   1. the task data (make_data.py; MAKE_DATA_ARGS passes it options) and a SentencePiece tokenizer
#      (`meridian tokenizer train`),
#   2. a LLaMA-architecture config.json sized for it (d_model 128, 4 layers, 4 heads / 2 KV heads, tied
#      embeddings while it pre-trains: 1.0M parameters),
#   3. pre-training on the text (`meridian train-local`), which writes an HF model directory,
#   4. the LM head untied from the embedding (untie.py: the same function, 1.3M parameters), so that a
#      pipeline can cut the model: the first stage holds the embedding and the last the head.
# usage: [PRETRAIN_SEQ=256] [PRETRAIN_BATCH=4] build_base.sh [WORK_DIR] [PRETRAIN_STEPS]
#        (defaults: examples/llm-finetune/work, 800 steps of 4 sequences of 256 tokens). The stronger
#        base that LoRA was measured on (examples/llm-finetune/README.md):
#        PRETRAIN_SEQ=256 PRETRAIN_BATCH=8 build_base.sh examples/llm-finetune/work-strong 800
# A base already in WORK_DIR/base built by the same script from the same text and steps is reused.
# Needs a build (scripts/build.sh). Takes about two and a half minutes on one core of this machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="${1:-$here/work}"
steps="${2:-800}"
bin="${MERIDIAN_BIN:-$root/build/bin}"
mkdir -p "$work/base-init"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# The text: every license text Debian ships (symlinks resolved, each once).
find /usr/share/common-licenses -maxdepth 1 -type f -o -maxdepth 1 -type l | xargs -n1 readlink -f | sort -u \
  | xargs cat > "$work/corpus.txt"
# The task data: cheap and deterministic, so written every time (the base does not depend on it).
python3 "$here/make_data.py" "$work/tasks.jsonl" --text "$work/corpus.txt" ${MAKE_DATA_ARGS:-}
# A base built by the same script from the same text and step count is reused (the demo's cache). The
# key does not cover the meridian binary: delete WORK_DIR/base after changing its tokenizer or trainer.
pre_seq="${PRETRAIN_SEQ:-256}"
pre_batch="${PRETRAIN_BATCH:-4}"
key=$( (cat "$0" "$work/corpus.txt"; echo "steps=$steps seq=$pre_seq batch=$pre_batch") | sha256sum | cut -c1-16)
if [ "$(cat "$work/base/.built-from" 2>/dev/null)" = "$key" ] && [ -f "$work/base/model.safetensors" ] \
   && [ -f "$work/base/config.json" ] && [ -f "$work/base/tokenizer.model" ]; then
  echo "reusing the base model in $work/base (built by the same script from the same text; delete it to rebuild)"
  exit 0
fi
rm -rf "$work/base"
# The tokenizer learns from the text alone (no task line, so held-out inputs stay unseen), plus the
# letters and digits standing alone, in both cases, often enough that each is one piece ("▁a", "▁A").
for _ in $(seq 100); do
  echo "a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z 0 1 2 3 4 5 6 7 8 9"
done > "$work/charset.txt"
"$bin/meridian" tokenizer train --input "$work/corpus.txt" --input "$work/charset.txt" --vocab-size 2000 \
  --out "$work/base-init" 2>/dev/null
cat > "$work/base-init/config.json" <<JSON
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 2048,
  "hidden_size": 128,
  "intermediate_size": 352,
  "num_hidden_layers": 4,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": true,
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
  global_batch: $pre_batch
  micro_batches: 1
  sequence_length: $pre_seq
  seed: 11
  optimizer: {name: adamw, lr: 3e-3, weight_decay: 0.01, warmup_steps: 10, min_lr_ratio: 0.1, grad_clip: 1.0}
YAML
echo "pre-training the base model for $steps steps of $pre_batch x $pre_seq tokens on $(wc -c < "$work/corpus.txt") bytes of text"
"$bin/meridian" train-local "$work/pretrain.yaml" --out "$work/base" \
  | awk 'NR == 1 || NR % 100 == 0 {print "  " $0; fflush()}'
# Tied while pre-training (measured: a base pre-trained untied reaches 44% held-out exact match after
# the fine-tuning where this one reaches 97%, examples/llm-finetune/README.md), untied for the pipeline.
python3 "$here/untie.py" "$work/base"
echo "$key" > "$work/base/.built-from"
echo "wrote $work/base (config.json, model.safetensors, tokenizer.model)"
