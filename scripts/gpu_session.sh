#!/usr/bin/env bash
# Several GPU measurements in one command, in order, each with its own log; everything they wrote is packed into one
# archive, $OUT/session.tgz, beside $OUT/session.txt (what ran, when, and what was skipped), again after each step
# ends, so that a command stopped by its wall-clock limit still leaves the steps that ended before.
#   bash scripts/gpu_session.sh STEP [STEP ...]
# A STEP is
#   "[VAR=value ...] COMMAND"      a `scripts/gpu.sh` command with its variables: check, "CASES=compact_moments bench"
#   ab:CASES:TREE[:TREE ...]       `python -m benchmarks.run --cases CASES` at each tree in turn (this checkout is
#                                  ".", another one's root a path: a `git worktree` or `git archive` of the commit
#                                  to compare), ROUNDS times over (2 unless set): A B A B, a process each
# DEADLINE=s: a step (or an ab run) that would start s seconds or more after the first is skipped, so that a
# command with a wall-clock limit still ends with its archive. COMMIT names this checkout's commit in the
# records; another tree's is read from its COMMIT file (`git rev-parse --short HEAD > TREE/COMMIT`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=$(mktemp -d); T0=$SECONDS

say() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$WORK/session.txt"; }
pack() {  # what the steps wrote so far, replacing the archive whole
  cp "$WORK/session.txt" "$OUT/session.txt"
  tar czf "$OUT/.session.tgz" -C "$WORK" . && mv "$OUT/.session.tgz" "$OUT/session.tgz"
}
due() {  # whether `$1` may still start
  if [[ -n ${DEADLINE:-} ]] && (( SECONDS - T0 >= DEADLINE )); then say "skipped: $1"; return 1; fi
}

OUT="$WORK/setup" bash scripts/gpu.sh setup > "$WORK/setup.log" 2>&1  # the wheels into /tmp/site, machine.txt

ab() {  # cases, trees...
  local cases=$1 round k tree name commit; shift
  for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
    for ((k = 1; k <= $#; k++)); do
      tree=${!k}
      name="ab-$k-$(basename "$(realpath "$tree")")-round$round"
      due "$cases at $tree, round $round" || continue
      commit=$(cat "$tree/COMMIT" 2>/dev/null || echo "${COMMIT:-unknown}")
      (cd "$tree" && PYTHONPATH=/tmp/site CASES="$cases" OUT="$WORK/$name" COMMIT="$commit" bash scripts/gpu.sh bench) \
        > "$WORK/$name.log" 2>&1  # the tree's own gpu.sh, with the wheels this one installed
      say "$cases at $tree ($commit), round $round: $(grep -c '"ok": true' "$WORK/$name/results.jsonl" 2>/dev/null \
        || echo 0) records ok"
      pack
    done
  done
}

n=0
for step in "$@"; do
  n=$((n + 1))
  due "$step" || continue
  if [[ $step == ab:* ]]; then
    IFS=: read -ra parts <<< "${step#ab:}"
    ab "${parts[@]}"
    continue
  fi
  read -ra words <<< "$step"
  command=${words[-1]}
  env "${words[@]:0:${#words[@]}-1}" OUT="$WORK/$n-$command" COMMIT="${COMMIT:-unknown}" \
    bash scripts/gpu.sh "$command" > "$WORK/$n-$command.log" 2>&1
  say "$step: exit $?"
  pack
done

say "packed into $OUT/session.tgz"
pack
