#!/usr/bin/env bash
# The CPU benchmarks on a quiet machine (a lent GPU machine has 16 idle cores; ours have 2,
# shared), for one or more source trees, alternating the trees benchmark by benchmark so that
# every tree is measured in the same minutes. Usage, from the repository root:
#   scripts/device_benchmarks.sh OUT_DIR TREE [TREE ...]      (TREE: "." or e.g. a `git archive`
#                                                             copy of an older commit)
# Results: OUT_DIR/<tree name, "head" for ".">/<bench>.json (+ .png) and .log. Wheels in .whl/ are installed as
# scripts/device_checks.sh does; a redis-server (and its libraries) in .redis/ is put on PATH for
# the fleet benchmark. Each benchmark is bounded by BENCH_TIMEOUT seconds (default 120).
#
# Two A/B benchmarks, not in the default list (one benchmark, two settings, on each tree,
# alternated A B B A ... so that a drift in the machine's state falls on both):
#   BENCHES="lookup_engine peers_window" scripts/device_benchmarks.sh OUT_DIR .
#   - lookup_engine: lookup_tail (TAIL_AB_ARGS, default none: 2,000 calls) with gRPC's polling
#     engine (the daemon's default) and with GRPC_EXPERIMENTS= (gRPC's own defaults),
#     TAIL_RUNS (3) runs each (~10 s each on idle cores);
#   - peers_window: bench_peers (PEERS_AB_ARGS, default 256 KiB / 1 MiB parts, 20 rounds:
#     ~1 min a run on idle cores) with B's stream windows of 32 MiB (the default) and of 8 MiB
#     (--stream-window), AB_RUNS (2) runs each.
# Each step is bounded by BENCH_TIMEOUT, all A/B steps together by AB_BUDGET seconds from the
# first (default 330; a step with under 30 s left is skipped). Results: OUT_DIR/<tree>/<bench>/
# <setting>-<n>.json and .log, and OUT_DIR/<tree>/<bench>/summary.txt (also printed).
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
declare -A ab_cmd=(
    [peers_window]="benchmarks.bench_peers ${PEERS_AB_ARGS:---parts 256KiB,1MiB --rounds 20}"
    [lookup_engine]="benchmarks.lookup_tail ${TAIL_AB_ARGS:-}"
)
declare -A ab_settings=([peers_window]="w32 w8" [lookup_engine]="polling default")
declare -A ab_runs=([peers_window]=${AB_RUNS:-2} [lookup_engine]=${TAIL_RUNS:-3})
ab_deadline=""  # set at the first A/B step

ab_step() {  # BENCH SETTING TREE BASE: one run of an A/B benchmark, BASE.json and BASE.log
    local bench=$1 setting=$2 tree=$3 base=$4 left=$(( ab_deadline - SECONDS ))
    local -a pre=() extra=()
    if [ "$left" -lt 30 ]; then echo "   $setting skipped: AB_BUDGET spent"; return; fi
    [ "$left" -gt "$limit" ] && left=$limit
    case $setting in
        w32) extra=(--stream-window 32MiB) ;;
        w8) extra=(--stream-window 8MiB) ;;
        polling) pre=(env -u GRPC_EXPERIMENTS) ;;
        default) pre=(env GRPC_EXPERIMENTS=) ;;
    esac
    echo "   $setting ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg), limit ${left}s)"
    (cd "$tree" && PYTHONPATH="${site:+$site:}$PWD" timeout "$left" ${pre[@]+"${pre[@]}"} \
        python3 -m ${ab_cmd[$bench]} ${extra[@]+"${extra[@]}"} --json "$base.json") >"$base.log" 2>&1 \
        || echo "   exit $? (see $base.log)"
}

ab_summary() {  # BENCH DIR: per run, the figures to compare; printed and in DIR/summary.txt
    python3 - "$1" "$2" <<'PY' | tee "$2/summary.txt"
import json, re, statistics, sys
from pathlib import Path
bench, d = sys.argv[1], Path(sys.argv[2])
steps = sorted(d.glob("*.log"), key=lambda p: p.stat().st_mtime)
by: dict = {}
for log in steps:
    setting = log.stem.split("-")[0]
    j = log.with_suffix(".json")
    if bench == "peers_window" and j.exists():
        for r in json.loads(j.read_text())["runs"][0]["results"]:
            by.setdefault((setting, r["part_bytes"]), []).append(r["ratio"])
            print(f"{log.stem:10} {r['part_bytes'] >> 10:5} KiB: stream/ref {r['ratio']:.2f} "
                  f"paired {r['paired_ratio_median']:.2f} floor {r['floor_ratio']:.2f} "
                  f"TLS {r['tls_ratio']:.2f} fetch {r['fetch_ms_median']:.1f} ms "
                  f"({r['stream_windows_per_fetch']} windows)")
    elif bench == "lookup_engine" and j.exists():
        text = log.read_text()
        for phase in ("by keys", "Health"):
            m = re.search(rf"== {phase}: \d+ calls, p50 ([\d.]+) ms, p99 ([\d.]+) ms", text)
            wake = re.search(rf"== {phase}:.*?\n(?:.*\n)*?  daemon thread wake-ups per call: "
                             r"median ([\d.]+)", text)
            if m:
                p50, p99 = float(m[1]), float(m[2])
                by.setdefault((setting, phase), []).append((p50, p99))
                print(f"{log.stem:10} {phase:8} p50 {p50:.3f} ms p99 {p99:.3f} ms, daemon "
                      f"wake-ups per call {wake[1] if wake else '?'}")
    else:
        print(f"{log.stem:10} no result (see {log.name})")
for (setting, what), got in sorted(by.items()):
    if bench == "peers_window":
        print(f"{setting:4} {what >> 10:5} KiB: stream/ref median {statistics.median(got):.2f} "
              f"of {len(got)} run(s): {' '.join(f'{x:.2f}' for x in got)}")
    else:
        print(f"{setting:8} {what:8} median of {len(got)} run(s): p50 "
              f"{statistics.median(g[0] for g in got):.3f} ms, p99 "
              f"{statistics.median(g[1] for g in got):.3f} ms")
PY
}

for bench in ${BENCHES:-daemon scheduler peers abuse cluster}; do
    for tree in "$@"; do
        name=$(basename "$(realpath "$tree")"); name=${name#.}
        [ "$(realpath "$tree")" = "$PWD" ] && name=head
        mkdir -p "$out/$name"
        if [ -n "${ab_cmd[$bench]:-}" ]; then
            echo "== A/B $bench on $name (${ab_settings[$bench]}, ${ab_runs[$bench]} runs each)"
            mkdir -p "$out/$name/$bench"
            [ -n "$ab_deadline" ] || ab_deadline=$(( SECONDS + ${AB_BUDGET:-330} ))
            read -r first second <<<"${ab_settings[$bench]}"
            for (( i = 1; i <= ab_runs[$bench]; i++ )); do
                order="$first $second"; (( i % 2 == 0 )) && order="$second $first"  # A B B A
                for setting in $order; do
                    ab_step "$bench" "$setting" "$tree" "$out/$name/$bench/$setting-$i"
                done
            done
            ab_summary "$bench" "$out/$name/$bench"
            continue
        fi
        echo "== $bench on $name ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
        (cd "$tree" && PYTHONPATH="${site:+$site:}$PWD" timeout "$limit" \
            python3 -m ${cmd[$bench]} --json "$out/$name/$bench.json") \
            >"$out/$name/$bench.log" 2>&1 || echo "   exit $? (see $name/$bench.log)"
        tail -n 14 "$out/$name/$bench.log" | grep -v '%|' 
    done
done
