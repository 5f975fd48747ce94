#!/usr/bin/env bash
# The profiles issue 30's matrices predict from, taken on this machine where OUT lacks them: an
# engine profile on every core (for `colocated`, one worker on both cores) and one on one core (for
# the two-worker layouts, one core each, as `baton up --layout` pins them), then each layout's
# served profile (`baton bench served-profile`: that engine profile calibrated through the real
# layout on a trace of its own, none of the matrices' runs). Run it on a quiet machine.
#
# The engine profile on every core, where OUT has one, is checked first (`baton profile --check`, a
# few minutes; the others were taken beside it): where this machine now runs more than 10% away
# from it, the script stops, since every prediction from the profiles would be off by as much (a
# host whose memory read 17 GB/s, where it read 27.6 when the profile was taken, ran decode 51% and
# prefill 213% off it). CHECK_PROFILE=0 skips the check.
#
#   scripts/layout_profiles.sh OUT
set -euo pipefail
out=${1:?usage: scripts/layout_profiles.sh OUT}
baton=${BATON:-baton}
mkdir -p "$out"
if [ -f "$out/profile-all-cores.json" ] && [ "${CHECK_PROFILE:-1}" != 0 ]; then
  if ! "$baton" profile --check "$out/profile-all-cores.json"; then
    echo "error: this machine drifted from $out/profile-all-cores.json: measure on a quiet machine like" \
      "the one it was taken on, or take the profiles again (remove them from $out); CHECK_PROFILE=0 runs anyway" >&2
    exit 1
  fi
fi
[ -f "$out/profile-all-cores.json" ] || "$baton" profile --output "$out/profile-all-cores.json"
last=$(($(nproc) - 1))
[ -f "$out/profile-one-core.json" ] ||
  OMP_NUM_THREADS=1 taskset -c "$last" "$baton" profile --output "$out/profile-one-core.json"
for layout in colocated 1p1d colocated:2; do
  profile=$out/profile-one-core.json
  [ "$layout" = colocated ] && profile=$out/profile-all-cores.json
  served=$out/served-${layout/:/-}.json
  [ -f "$served" ] || "$baton" bench served-profile --profile "$profile" --layout "$layout" --output "$served"
done
