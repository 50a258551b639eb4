#!/usr/bin/env bash
# The CUDA measurements of issues 12, 14 and 15 on a lent GPU machine, in parts that each
# fit one 10-minute device call. On that machine torch, JAX and hypothesis are installed but
# not purestep's other dependencies: carry the wheels in `.whl/` (msgspec, schedulefree,
# lion-pytorch, sophia-opt, heavyball; see benchmarks/README.md), then run
#
#     bash benchmarks/cuda_session.sh 1    # AdamW speed, folded chain, compile time
#     bash benchmarks/cuda_session.sh 2    # GPT step, Muon, Trainer, adapter
#     bash benchmarks/cuda_session.sh 3    # low-precision state
#     bash benchmarks/cuda_session.sh 4    # the test suite on one GPU
#     bash benchmarks/cuda_session.sh lease  # one call of 9 minutes: the CUDA tests, then 1 and 2 trimmed
#
# `lease` is for a session lent 15 device minutes in all (one start plus one full call): the
# tests that need CUDA first, then parts 1 and 2 with shorter limits and fewer sizes; the
# results tarball is rewritten after each step, so a call stopped at its limit still returns
# what finished.
# Results land in benchmarks/results/ and, as a tarball, in $OUT (what the device tool returns).
set -u
part=${1:?which part: 1, 2, 3 or 4}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1  # JAX would take 75% of GPU memory per process
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# purestep itself by path: an editable install does not work on that machine.
mkdir -p /tmp/pkg/purestep && ln -sfn "$PWD/core" /tmp/pkg/purestep/core && ln -sfn "$PWD/api" /tmp/pkg/purestep/api
export PYTHONPATH=/tmp/pkg:/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

save() {  # the results so far, as one tarball in $OUT (what the device tool returns)
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/results-part$part.tgz" benchmarks/results; fi
}

bench() {  # bench SECONDS SCRIPT ARGS...: one benchmark, its own time limit, never the whole part
    local limit=$1; shift
    echo "== $* (limit ${limit}s)"
    timeout "$limit" python3 "benchmarks/$@" || echo "!! $1 exited with $?"
    save
}

case $part in
1)
    bench 200 bench_optimizer.py --no-heavyball
    bench 150 bench_folded.py --sizes 10e6,100e6
    bench 220 bench_compile.py --tensors 25,100,200 --no-leaves
    ;;
2)
    bench 150 bench_gpt.py
    bench 150 bench_muon.py --layers 8 --dim 1024 --steps 20 --warmup 3
    bench 150 bench_trainer.py
    bench 120 bench_adapter.py --device cuda
    ;;
3)
    bench 560 bench_lowprec.py
    ;;
4)
    # -v into a file in $OUT: each test's outcome is written as it ends, so a run stopped at
    # its limit still names its failures (a -q run prints them only in the final summary).
    timeout 570 python3 -m pytest -v -n 14 -p no:cacheprovider tests property_tests > "${OUT:-/tmp}/tests.log" 2>&1
    grep -E " (FAILED|ERROR) " "${OUT:-/tmp}/tests.log" | head -80; tail -5 "${OUT:-/tmp}/tests.log"
    ;;
lease)
    echo "== the tests that need CUDA (limit 120s)"
    timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider -k "cuda or Cuda or CUDA" \
        tests/core/test_cuda.py tests/core/test_precision_cuda.py tests/core/test_flat.py \
        tests/api/test_trainer.py tests/api/test_distributed.py > "${OUT:-/tmp}/cuda-tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  " "${OUT:-/tmp}/cuda-tests.log" | head -60; tail -3 "${OUT:-/tmp}/cuda-tests.log"
    bench 150 bench_optimizer.py --no-heavyball --reps 30
    bench 110 bench_gpt.py
    bench 80 bench_muon.py --layers 8 --dim 1024 --steps 20 --warmup 3
    bench 90 bench_trainer.py --reps 5
    bench 60 bench_adapter.py --device cuda
    bench 70 bench_folded.py --sizes 10e6,100e6
    ;;
esac
save
