# Three turns: decode on core 1 alone, then beside 1,024-token prefills on core 0 (run from the
# repository root: bash docs/bench/zen3/2026-12-07e/interf.sh > interf.out).
here=$(dirname "$0")
tmp=$(mktemp -d)
for i in 1 2 3; do
  echo "alone $i"; taskset -c 1 .venv/bin/python "$here/interf.py" decode 2>/dev/null | tail -1
  rm -f "$tmp"/prefill.*
  taskset -c 0 .venv/bin/python "$here/interf.py" prefill 1024 "$tmp" >"$tmp/prefill.log" 2>&1 &
  pp=$!
  for _ in $(seq 300); do [ -f "$tmp/prefill.ready" ] && break; sleep 1; done
  echo "beside $i"; taskset -c 1 .venv/bin/python "$here/interf.py" decode 2>/dev/null | tail -1
  touch "$tmp/prefill.stop"; wait $pp; tail -1 "$tmp/prefill.log"
done
rm -rf "$tmp"
