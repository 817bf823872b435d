#!/bin/bash
# What sglang 0.5.17 needs carried to the offline GPU machine (CPU side; needs PyPI): the first
# half of a bundle, as ../shared/tools/vllm_on_gpu builds one for vLLM 0.24 (docs/sglang.md,
# "What a 0.5.17 bundle for the GPU machine holds"). It resolves, selects, downloads and
# prints the sizes; trimming, compressing, splitting and the GPU side are not written yet.
#
#   VLLM_ON_GPU=<that folder> bash tools/sglang_on_gpu/closure.sh [OUTDIR]   (default ./.sglang_closure)
#
# It reuses that tool's helpers and data rather than copies of them: bundle.py (pip with the
# GPU machine's environment markers, constraints, select), image_packages.txt, drop_packages.txt.
# Differences from the vLLM selection, and why:
#   - transformers and tokenizers are taken out of the image list: 0.5.17 pins
#     transformers==5.12.1 (tokenizers<=0.23.0), the image has 5.17.0 / 0.23.2, so both are carried;
#   - flashinfer-python is carried (sglang uses it behind availability checks; 15 MB);
#   - the cutlass-dsl libraries whose parent the drop list drops are dropped too.
# Output: OUTDIR/manifest.tsv, carry.txt, download/ (the wheels), sizes.txt.
set -euo pipefail
T=${VLLM_ON_GPU:?set VLLM_ON_GPU to ../shared/tools/vllm_on_gpu}
OUT=${1:-.sglang_closure}
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

# Sizes: the wheels, and sglang-kernel without its FlashAttention library (served with
# --attention-backend triton instead), whose import sgl_kernel guards.
"$VPY" - "$OUT" <<'EOF' | tee "$OUT/sizes.txt"
import glob, os, sys, zipfile
out = sys.argv[1]
wheels = sorted(glob.glob(os.path.join(out, "download", "*.whl")), key=os.path.getsize, reverse=True)
total = sum(map(os.path.getsize, wheels))
print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB")
for w in wheels[:8]:
    print(f"  {os.path.getsize(w) / 1e6:8.1f} MB  {os.path.basename(w)}")
for w in wheels:
    if os.path.basename(w).startswith("sglang_kernel-"):
        infos = zipfile.ZipFile(w).infolist()
        fa = sum(i.compress_size for i in infos if i.filename.endswith("/flash_ops.abi3.so"))
        print(f"without sgl_kernel/flash_ops.abi3.so: {(total - fa) / 1e6:.1f} MB "
              f"(it is {fa / 1e6:.1f} MB compressed, "
              f"{sum(i.file_size for i in infos if i.filename.endswith('/flash_ops.abi3.so')) / 1e6:.0f} MB raw)")
EOF
