#!/usr/bin/env bash
# The CPU benchmarks on a quiet machine (a lent GPU machine has 16 idle cores; ours have 2,
# shared), for one or more source trees, alternating the trees benchmark by benchmark so that
# every tree is measured in the same minutes. Usage, from the repository root:
#   scripts/device_benchmarks.sh OUT_DIR TREE [TREE ...]      (TREE: "." or e.g. a `git archive`
#                                                             copy of an older commit)
# Results: OUT_DIR/<tree name, "head" for ".">/<bench>.json (+ .png) and .log. Wheels in .whl/ are installed as
# scripts/device_checks.sh does; a redis-server (and its libraries) in .redis/ is put on PATH for
# the fleet benchmark. Each benchmark is bounded by BENCH_TIMEOUT seconds (default 120).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1"); shift
mkdir -p "$out"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
    [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    site=/tmp/site
fi
if [ -x .redis/redis-server ]; then
    export PATH="$PWD/.redis:$PATH" LD_LIBRARY_PATH="$PWD/.redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1
limit=${BENCH_TIMEOUT:-120}
declare -A cmd=(
    [daemon]="benchmarks.bench_daemon --repeats 12 --lookup-iters 2000 --no-redis --no-progress"
    [scheduler]="benchmarks.bench_scheduler --start-daemon"
    [peers]="benchmarks.bench_peers"
    [abuse]="benchmarks.bench_abuse"
    [cluster]="benchmarks.bench_cluster"
)
for bench in ${BENCHES:-daemon scheduler peers abuse cluster}; do
    for tree in "$@"; do
        name=$(basename "$(realpath "$tree")"); name=${name#.}
        [ "$(realpath "$tree")" = "$PWD" ] && name=head
        mkdir -p "$out/$name"
        echo "== $bench on $name ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
        (cd "$tree" && PYTHONPATH="${site:+$site:}$PWD" timeout "$limit" \
            python3 -m ${cmd[$bench]} --json "$out/$name/$bench.json") \
            >"$out/$name/$bench.log" 2>&1 || echo "   exit $? (see $name/$bench.log)"
        tail -n 14 "$out/$name/$bench.log" | grep -v '%|' 
    done
done
