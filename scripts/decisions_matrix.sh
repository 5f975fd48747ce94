#!/usr/bin/env bash
# Issue 30's decision bar on this machine: for each scenario ({decode-heavy, prefill-heavy} x
# {Poisson, Gamma CV 2}, the fidelity matrix's mixes and SLOs), every layout's measured goodput on a
# shared rate grid beside the plan's pick (`baton bench decisions`), each layout predicted from its
# served profile (scripts/layout_profiles.sh, taken first where OUT has none). Run it on a quiet
# machine: nothing else may run.
#
#   scripts/decisions_matrix.sh OUT [WINDOW_S]
set -euo pipefail
out=${1:?usage: scripts/decisions_matrix.sh OUT [WINDOW_S]}
window=${2:-30}
baton=${BATON:-baton}
BATON=$baton "$(dirname "$0")/layout_profiles.sh" "$out"
"$baton" bench decisions --profile colocated="$out/served-colocated.json" 1p1d="$out/served-1p1d.json" \
  colocated:2="$out/served-colocated-2.json" \
  --mix uniform:128:384/uniform:64:192 uniform:512:1024/uniform:32:96 --arrivals poisson,gamma:2 \
  --slo ttft:2000 tpot:100 --window "$window" --seed 0 --output-jsonl "$out/decisions.jsonl" |
  tee "$out/decisions.log"
