#!/usr/bin/env bash
# What travels to a GPU machine besides the checkout (run here, where PyPI and ../shared are reachable):
#   .whl/       wheels for CPython 3.12 on manylinux x86_64 of what the GPU machines lack (cffi, pycparser):
#               downloaded once, kept while both are there
#   .gpu-data/  the data the GPU check's equality and bench stages read: the first 1024 SST train trees, PTB's
#               valid split; COMMIT, the commit packed (the checkout's .git may not travel)
# Both are git-ignored; name them in the device call's carry: [".whl", ".gpu-data"] (docs/gpu.md).
#   bash tools/gpu_pack.sh [SHARED_DATA_DIR]      (default ../shared/data, else ../../shared/data: a worktree)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data}
[ -n "${1:-}" ] || [ -d "$data" ] || data=../../shared/data
[ -f "$data/sst/train.txt" ] || { echo "gpu_pack: $data/sst/train.txt not found (pass the data folder)"; exit 1; }
[ -f "$data/ptb/ptb.valid.txt" ] || { echo "gpu_pack: $data/ptb/ptb.valid.txt not found"; exit 1; }
wheels=(cffi==2.0.0 pycparser==2.23)
packed=(".whl/cffi-2.0.0-cp312-cp312-manylinux*_x86_64.whl" ".whl/pycparser-2.23-py3-none-any.whl")
have() { compgen -G "$1" > /dev/null; }
mkdir -p .whl .gpu-data/sst .gpu-data/ptb
if have "${packed[0]}" && have "${packed[1]}"; then
    echo "gpu_pack: wheels already packed (remove .whl/ to download them again)"
else
    rm -f .whl/*.whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${wheels[@]}"
    for w in "${packed[@]}"; do have "$w" || { echo "gpu_pack: the download gave no $w"; exit 1; }; done
fi
head -n 1024 "$data/sst/train.txt" > .gpu-data/sst/train.txt.tmp     # one tree per line
mv .gpu-data/sst/train.txt.tmp .gpu-data/sst/train.txt
cat "$data/ptb/ptb.valid.txt" > .gpu-data/ptb/ptb.valid.txt.tmp
mv .gpu-data/ptb/ptb.valid.txt.tmp .gpu-data/ptb/ptb.valid.txt
git rev-parse HEAD > .gpu-data/COMMIT 2>/dev/null || echo unknown > .gpu-data/COMMIT
echo "gpu_pack: $(ls .whl | tr '\n' ' '); $(wc -l < .gpu-data/sst/train.txt) SST trees, $(wc -l < .gpu-data/ptb/ptb.valid.txt) PTB lines; $(du -sh .whl .gpu-data | awk '{print $1}' | tr '\n' ' ')"
