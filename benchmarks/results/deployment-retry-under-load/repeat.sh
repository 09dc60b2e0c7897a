#!/usr/bin/env bash
# Issue 44, item 7: the deployment-retry tests N times in a row beside two busy CPU loops (on a 2-core machine
# the load average then sits above 3), one log per run and a line each in OUT/summary.txt.
#   bash repeat.sh REPO OUT [N]     (REPO: a clone with its .venv, `make install`)
cd "$1" || exit 2
out="$2"; n="${3:-10}"
mkdir -p "$out"
burn() { python3 -c "while True: pass" >/dev/null 2>&1 & echo $!; }
B1=$(burn); B2=$(burn)
trap 'kill $B1 $B2 2>/dev/null' EXIT
for i in $(seq 1 "$n"); do
  s=$(date +%s)
  timeout 900 .venv/bin/pytest -q -p no:cacheprovider tests/integration/test_deployment_retry.py >"$out/run-$i.log" 2>&1
  rc=$?
  echo "run $i rc=$rc $(($(date +%s) - s))s $(tail -1 "$out/run-$i.log")" >>"$out/summary.txt"
done
