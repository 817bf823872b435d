#!/usr/bin/env bash
# The folder an e2e benchmark serves: the model's config.json with the tokenizer's files (the
# weights are the framework's dummy ones).
#
#   bash tools/e2e/served_folder.sh MODEL_DIR TOKENIZER_DIR OUT_DIR
#
# Exits 2, naming the folder, where MODEL_DIR has no config.json or TOKENIZER_DIR no tokenizer.json.
set -u
[ $# -eq 3 ] || { echo "usage: served_folder.sh MODEL_DIR TOKENIZER_DIR OUT_DIR" >&2; exit 2; }
model_dir=$1 tokenizer_dir=$2 out=$3
[ -f "$model_dir/config.json" ] || { echo "served_folder: no config.json in $model_dir" >&2; exit 2; }
[ -f "$tokenizer_dir/tokenizer.json" ] || { echo "served_folder: no tokenizer.json in $tokenizer_dir" >&2; exit 2; }
mkdir -p "$out" && cp "$model_dir/config.json" "$out/" || exit 2
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  if [ -f "$tokenizer_dir/$f" ]; then cp "$tokenizer_dir/$f" "$out/" || exit 2; fi
done
