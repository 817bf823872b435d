#!/bin/bash
# The sglang 0.5.17 bundle for the offline GPU machine (CPU side; needs PyPI and ~2 GB of disk).
# docs/sglang.md, "What a 0.5.17 bundle for the GPU machine holds", says what is in it and why;
# tools/sglang_on_gpu/README.md how it is carried and run.
#
#   VLLM_ON_GPU=<../shared/tools/vllm_on_gpu> bash tools/sglang_on_gpu/build_bundle.sh [OUTDIR]
#   (OUTDIR defaults to ./.sglang_bundle, git-ignored)
#
# The bundle has the layout of that tool's bundles (parts/part.NN, SHA256SUMS, manifest.tsv),
# so its stage.sh carries it and its gpu_run.sh installs it. It reuses that tool's helpers and
# data rather than copies of them: bundle.py (pip with the GPU machine's environment markers,
# constraints, select, repack), image_packages.txt and drop_packages.txt. What differs from
# the vLLM selection, and why:
#   - transformers and tokenizers are taken out of the image list: 0.5.17 pins
#     transformers==5.12.1 (tokenizers<=0.23.0), the image has 5.17.0 / 0.23.2, so both are carried;
#   - flashinfer-python is carried (sglang uses it behind availability checks; 15 MB);
#   - the cutlass-dsl libraries whose parent the drop list drops are dropped too;
#   - sgl_kernel/flash_ops.abi3.so (1.1 GB raw: sgl_kernel's FlashAttention builds, whose
#     import it guards) is removed: serve with --attention-backend triton.
# Environment: PART_MB (60), XZ_LEVEL (9), XZ_THREADS (2), SIZES_ONLY=1 (stop after the
# download and print the sizes).
set -euo pipefail
T=${VLLM_ON_GPU:?set VLLM_ON_GPU to ../shared/tools/vllm_on_gpu}
OUT=${1:-.sglang_bundle}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd -P)
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_REQUIREMENT PIP_NO_INDEX PIP_TARGET 2>/dev/null || true

VPY=$OUT/venv/bin/python
if [ ! -x "$VPY" ]; then
  python3 -m venv "$OUT/venv"
  "$VPY" -m pip install -q -U "pip>=25" packaging
fi
# The GPU machine's wheels: CPython 3.12 on manylinux x86_64 up to glibc 2.35 (as vllm_on_gpu).
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for n in $(seq 5 35); do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any)

grep -vE '^(transformers|tokenizers)==' "$T/image_packages.txt" > "$OUT/image.txt"
{ grep -vE '^flashinfer-python\b' "$T/drop_packages.txt"
  printf '%s  # parent nvidia-cutlass-dsl is dropped\n' nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 \
    nvidia-cuda-nvdisasm; } > "$OUT/drop.txt"
"$VPY" "$T/bundle.py" constraints "$OUT/image.txt" > "$OUT/constraints.txt"
"$VPY" "$T/bundle.py" pip install --dry-run --ignore-installed --quiet --report "$OUT/report.json" \
  "${PLAT[@]}" -c "$OUT/constraints.txt" sglang==0.5.17
"$VPY" "$T/bundle.py" select "$OUT/report.json" "$OUT/image.txt" "$OUT/drop.txt" "$OUT"
"$VPY" -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/download" -r "$OUT/carry.txt"

# Sizes: the wheels, and sglang-kernel without its FlashAttention library.
"$VPY" - "$OUT" << 'PY' | tee "$OUT/sizes.txt"
import glob, os, sys, zipfile
out = sys.argv[1]
wheels = sorted(glob.glob(os.path.join(out, "download", "*.whl")), key=os.path.getsize, reverse=True)
total = sum(map(os.path.getsize, wheels))
print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB")
for w in wheels[:8]:
    print(f"  {os.path.getsize(w) / 1e6:8.1f} MB  {os.path.basename(w)}")
for w in wheels:
    if os.path.basename(w).startswith("sglang_kernel-"):
        fa = [i for i in zipfile.ZipFile(w).infolist() if i.filename.endswith("/flash_ops.abi3.so")]
        print(f"without sgl_kernel/flash_ops.abi3.so: {(total - sum(i.compress_size for i in fa)) / 1e6:.1f} MB "
              f"(it is {sum(i.compress_size for i in fa) / 1e6:.1f} MB compressed, "
              f"{sum(i.file_size for i in fa) / 1e6:.0f} MB raw)")
PY
[ -z "${SIZES_ONLY:-}" ] || exit 0

# Stored uncompressed (xz sees raw bytes) with bundle.py's trims (xgrammar's static library),
# then sglang-kernel once more through the same function, without flash_ops.
rm -rf "$OUT/bundle"
"$VPY" "$T/bundle.py" repack "$OUT/carry.txt" "$OUT/download" "$OUT/bundle/wheels"
"$VPY" - "$T" "$OUT/bundle/wheels" << 'PY'
import glob, os, sys
sys.path.insert(0, sys.argv[1])
import bundle
(wheel,) = glob.glob(os.path.join(sys.argv[2], "sglang_kernel-*.whl"))
n, size = bundle.repack(wheel, wheel + ".tmp", {"drop": ["sgl_kernel/flash_ops.abi3.so"], "keep": []})
os.replace(wheel + ".tmp", wheel)
print(f"  {os.path.basename(wheel)}: removed {n} file, {size / 1e6:.0f} MB raw")
PY
cp "$OUT/carry.txt" "$OUT/manifest.tsv" "$OUT/bundle/"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$OUT" -cf - bundle \
  | xz -"${XZ_LEVEL:-9}" -T"${XZ_THREADS:-2}" > "$OUT/bundle.tar.xz"
rm -rf "$OUT/parts" "$OUT/bundle"
mkdir -p "$OUT/parts"
split -b "${PART_MB:-60}M" -d -a 2 "$OUT/bundle.tar.xz" "$OUT/parts/part."
{ (cd "$OUT/parts" && sha256sum part.*)
  echo "$(sha256sum < "$OUT/bundle.tar.xz" | cut -d' ' -f1)  bundle.tar.xz"; } > "$OUT/SHA256SUMS"
echo "bundle: $(stat -c %s "$OUT/bundle.tar.xz") bytes in $(ls "$OUT/parts" | wc -l) parts of ${PART_MB:-60} MiB" \
  | tee -a "$OUT/sizes.txt"
