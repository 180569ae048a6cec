#!/usr/bin/env bash
# musubi-tuner's source at the commit bench/musubi_side.py was written against, into bench/third_party/musubi_tuner
# (untracked, in .gitignore: its hunyuan_model/ follows Tencent's HunyuanVideo license; a lent GPU gets it with
# the device tool's `carry`, and tests/test_bench_musubi_side.py runs where it is). Only the package dirs and files
# bench.musubi_side imports or reads: the Qwen-Image and FLUX.1 Kontext DiTs, the LoRA networks, the offloader,
# the fp8 utilities, the trainer base and the two train scripts. From the local mirror if there is one, else
# from GitHub (a shallow fetch of that one commit).
#   bash bench/musubi_source.sh            # MUSUBI_REPO=<git dir> to read another clone
set -euo pipefail
COMMIT=30c658c4f4b0bf05038b3346eff9670259b10fc7  # kohya-ss/musubi-tuner main, 2026-06-24 (PR #982 merged)
URL=https://github.com/kohya-ss/musubi-tuner
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/bench/third_party/musubi_tuner"
PKG=src/musubi_tuner
PATHS=(
  "$PKG/__init__.py"
  "$PKG/qwen_image" "$PKG/flux" "$PKG/hunyuan_model" "$PKG/modules" "$PKG/networks" "$PKG/training" "$PKG/utils"
  "$PKG/qwen_image_train_network.py" "$PKG/flux_kontext_train_network.py"
)

repo="${MUSUBI_REPO:-/work/.mirror/kohya-ss+musubi-tuner/repo}"
tmp=""
if ! git --git-dir="$repo" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  git -C "$tmp" init -q
  git -C "$tmp" fetch -q --depth 1 "$URL" "$COMMIT"
  repo="$tmp/.git"
fi

rm -rf "$DEST"
mkdir -p "$DEST"
git --git-dir="$repo" archive "$COMMIT" "${PATHS[@]}" | tar -x -C "$DEST"
# Apache-2.0 (README.md, "License"; hunyuan_model/ follows HunyuanVideo's license): say where this came from
printf 'repo %s\ncommit %s\nlicense Apache-2.0 (see the repo README "License")\n' "$URL" "$COMMIT" > "$DEST/SOURCE"
find "$DEST" -name '__pycache__' -prune -exec rm -rf {} +
echo "musubi-tuner $COMMIT -> $DEST: $(du -sh "$DEST" | cut -f1), $(find "$DEST" -type f | wc -l) files"
