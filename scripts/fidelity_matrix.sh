#!/usr/bin/env bash
# Issue 30's fidelity matrix on this machine: {colocated, 1p1d, colocated:2} x {30, 60, 90, 120}% of
# each layout's predicted capacity x {Poisson, Gamma CV 2} x 2 length mixes, each a real `baton up`
# run beside the simulator's prediction of the same requests (`baton bench fidelity`).
#
# A layout of one worker runs on every core and is predicted from a profile taken on every core; a
# layout of two workers (one core each, as `baton up --layout` pins them) from a profile taken on one
# core. Each layout's prediction uses its served profile: that engine profile calibrated through the
# real layout (`baton bench served-profile`, a trace of its own, none of the runs below); the
# profiles are taken first where OUT has none (scripts/layout_profiles.sh). Run it on a quiet
# machine: nothing else may run (a test suite beside it made served steps 5-10x slower here). Each
# run is also predicted at the speed a probe read just before it (planner/probe.py; the report's
# last line): where that is much closer than the profile's own, the host moved during the matrix.
#
#   scripts/fidelity_matrix.sh OUT [WINDOW_S]
#
# SLO="ttft:MS tpot:MS" replaces the SLOs (TTFT 2 s, TPOT 100 ms) for a kind whose prefill cannot
# meet them at any rate: an AVX2-only Zen 3 prefills a 1,024-token prompt in ~3.6 s on one core
# (its profile of 2026-12-07), so no two-worker layout serves the prefill-heavy mix within 2 s.
set -euo pipefail
out=${1:?usage: scripts/fidelity_matrix.sh OUT [WINDOW_S]}
window=${2:-30}
baton=${BATON:-baton}
mkdir -p "$out"
read -r -a slo <<< "${SLO:-ttft:2000 tpot:100}"
mixes=(uniform:128:384/uniform:64:192 uniform:512:1024/uniform:32:96)

BATON=$baton "$(dirname "$0")/layout_profiles.sh" "$out"
for layout in colocated 1p1d colocated:2; do
  served=$out/served-${layout/:/-}.json
  "$baton" bench fidelity --profile "$served" --layout "$layout" --mix "${mixes[@]}" \
    --loads 0.3,0.6,0.9,1.2 --arrivals poisson,gamma:2 --window "$window" --slo "${slo[@]}" \
    --output-jsonl "$out/runs.jsonl"
done
"$baton" bench fidelity-report "$out/runs.jsonl" | tee "$out/report.md"
# the same runs predicted from the engine profiles alone, for comparison
"$baton" bench fidelity-report "$out/runs.jsonl" --profile colocated="$out/profile-all-cores.json" \
  1p1d="$out/profile-one-core.json" colocated:2="$out/profile-one-core.json" | tee "$out/report-engine-profile.md"
