#!/bin/sh
# Few-row GEMM microbenchmark (issue 17): numpy's OpenBLAS against Intel MKL's packed GEMM.
# MKL is not a dependency of minicavs; get its libraries once, outside the repository:
#   pip download mkl --no-deps -d /tmp/mklwheel && unzip -q /tmp/mklwheel/mkl-*.whl -d /tmp/mklwheel
#   MKLLIB=$(ls -d /tmp/mklwheel/mkl-*.data/data/lib); (cd $MKLLIB && for f in *.so.*; do ln -sf $f ${f%%.so.*}.so; done)
# then: MKLLIB=... sh tools/fewrows_blas/run.sh
#   bench: GFLOP/s per (K, N, M) at 1 thread (CPU time) and 2 threads (wall; 2 threads: run one library per process)
#   replay: the Var-LSTM h512 b64 recurrent products of 16 batches (varlstm_rows.txt: rows per timestep) as the
#           C runner routes them vs MKL packed (one pack per pass), ms per training step
set -e
here=$(dirname "$0")
ob=$(python -c "import numpy, glob, os; print(glob.glob(os.path.join(os.path.dirname(numpy.__file__), '..', 'numpy.libs', 'libscipy_openblas*'))[0])")
rt=$MKLLIB/libmkl_rt.so.2
[ -e "$rt" ] || rt=$(ls "$MKLLIB"/libmkl_rt.so.* | head -1)
out=${TMPDIR:-/tmp}/fewrows_blas; mkdir -p "$out"
cc -O2 -o "$out/bench" "$here/bench.c" -ldl -lpthread
cc -O2 -march=native -o "$out/replay" "$here/replay.c" -ldl -lpthread
export LD_LIBRARY_PATH="$MKLLIB"
uptime
CPU=1 "$out/bench" "$ob" "$rt" 1 seq 110110
"$out/replay" "$ob" "$rt" "$here/varlstm_rows.txt" 7
for i in 1 2 3; do   # 2 threads, alternating: OpenBLAS's own pool, then MKL sequential split over our 2 threads
  TWO=ob "$out/replay" "$ob" "$rt" "$here/varlstm_rows.txt" 5 | tail -1
  TWO=split "$out/replay" "$ob" "$rt" "$here/varlstm_rows.txt" 5 | tail -1
done
uptime
