#!/usr/bin/env bash
# One call on a lent GPU machine (many cores, no network, a deadline): the closed loop of several
# bundles on the same seeds, every core busy, and one small archive of the reports back. Run from
# the repository root, after scripts/gpu_record_train.sh on the same (warm) machine:
#
#   BUNDLES="bundles/transfer_cube-smolvla gpu_work/run gpu_work/run/steps/*" CARRY=.gpucarry OUTDIR=$OUT \
#     scripts/gpu_eval.sh
#
# Why: here (2 cores) 100 episodes of one bundle take ~30 minutes, so a session judges two or three
# bundles; there, 15 processes judge the final bundle and its kept steps against the bundle they
# started from in minutes (one run's score swings ~9 points between steps 32 apart, and neither
# the validation loss nor the last step says which acts best). Every (bundle, noise scale, slice of
# seeds) is one `vla-accel eval` process under `timeout`; the first bundle at the first noise scale
# is the reference of the paired table (`vla-accel bench outcomes`) written to summary.txt.
# Back: evals.tar.gz (each slice's report.json and report.md), run_eval.log, summary.txt. Unpack with
#   mkdir -p evals && tar -xzf OUTDIR/evals.tar.gz -C evals
# and compare with `vla-accel bench outcomes` as summary.txt shows. The machine differs from the
# CPU here (other floating-point sums, so other episodes): compare bundles evaluated on one machine.
set -u
T0=$SECONDS
BUNDLES=${BUNDLES:-bundles/transfer_cube-smolvla}  # space-separated; the first is the reference
DEADLINE_S=${DEADLINE_S:-250}          # no slice is started after DEADLINE_S - SLICE_S; each runs under a timeout to DEADLINE_S
SLICE_S=${SLICE_S:-120}                # the longest a slice may need (its timeout when started later)
PROCS=${PROCS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}
SEED=${SEED:-95000}                    # seed of episode 0: not the seeds trained on, nor 100000.. (this CPU's test seeds)
EPISODES=${EPISODES:-50}               # per bundle
SLICE=${SLICE:-5}                      # episodes per process
STEPS=${STEPS:-0}                      # control steps per episode (0: the task's)
# Each bundle at each of these noise scales: 0 is what the SmolVLA bundle ships (deterministic chunks),
# 1 the distribution training moves. A run can keep its start at 1 and lose it at 0 (run K,
# docs/policy-experiments.md), so a run is judged at both.
NOISE_SCALES=${NOISE_SCALES:-0 1}
EVAL_ARGS=${EVAL_ARGS:---modes baseline --threads 1 --open-loop-episodes 0}
# Each bundle's first chunks at tick 0 of FIRST_DEMOS expert demonstrations (seeds SEED..): the arm is
# at home on every seed, so only the cube tells them apart; report.json's first_chunk slope is ~0
# for a policy that goes where the cube usually is (docs/policy-experiments.md). 0: not checked.
FIRST_DEMOS=${FIRST_DEMOS:-40}

LOG_NAME=run_eval.log
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"

EVALS=$WORKDIR/evals
rm -rf "$EVALS" && mkdir -p "$EVALS"
bundles=()
names=()
noises=()
for b in $BUNDLES; do
  if [ ! -f "$b/config.json" ]; then
    say "FAILED: BUNDLES names $b, which is not a bundle (no config.json)"
    echo "failed: no bundle $b" >> "$SUMMARY"
    exit 1
  fi
  name=$(echo "$b" | sed 's#/*$##; s#^\./##; s#[^A-Za-z0-9._-]#_#g')
  for noise in $NOISE_SCALES; do  # one evaluation per (bundle, noise scale), named BUNDLE_nNOISE
    bundles+=("$b")
    names+=("${name}_n$noise")
    noises+=("$noise")
  done
done
# Every bundle integrates in the reference's step count: `vla-accel train` writes 10 into what it
# trains whatever its start runs (the shipped SmolVLA bundle: 20), and a run is judged against its
# start at the same integration.
FLOW_STEPS=$("$PY" -c 'import sys; from vla_accel_ros.core.bundle import read_spec; print(read_spec(sys.argv[1]).num_steps)' "${bundles[0]}")
EVAL_ARGS="--flow-steps $FLOW_STEPS $EVAL_ARGS"
# Slices in the order bundle 1 slice 1, bundle 2 slice 1, ... (each bundle at each noise scale):
# cut by the deadline, every evaluation keeps the same seeds.
order=$WORKDIR/eval_order
: > "$order"
for (( s = 0; s < EPISODES; s += SLICE )); do
  for i in "${!bundles[@]}"; do
    echo "${bundles[$i]} ${names[$i]} ${noises[$i]} $(( SEED + s )) $(( EPISODES - s < SLICE ? EPISODES - s : SLICE ))" >> "$order"
  done
done
END=$(( T0 + DEADLINE_S ))
firsts=()
if [ "$FIRST_DEMOS" -gt 0 ]; then  # first in the queue: one process per bundle, at noise 0
  read -r first_noise _ <<< "$NOISE_SCALES"
  for i in "${!bundles[@]}"; do
    [ "${noises[$i]}" = "$first_noise" ] || continue  # each bundle once
    firsts+=("${names[$i]%_n*}")
    echo "${bundles[$i]} first_${names[$i]%_n*} first $SEED 1" >> "$order.first"
  done
  cat "$order" >> "$order.first" && mv "$order.first" "$order"
fi
run_slice() {  # BUNDLE NAME NOISE SEED N: one process, its report in EVALS/NAME/SEED; none started too late to end
  local left=$(( END - SECONDS ))
  [ "$left" -ge "$SLICE_S" ] || { echo "not started (deadline): $2 seed $4" >> "$LOG"; return 0; }
  if [ "$3" = first ]; then  # the first-chunk check: one closed-loop episode, FIRST_DEMOS frames at tick 0
    timeout -k 10 "$left" "${VLA[@]}" eval --bundle "$1" --episodes 1 --seed "$4" "${STEP_ARGS[@]}" --modes baseline \
      --threads 1 --flow-steps "$FLOW_STEPS" --open-loop-episodes "$FIRST_DEMOS" --open-loop-stride 100000 --noise-scale 0 \
      --no-plots --no-progress --report "$EVALS/first/$2" >> "$LOG" 2>&1 || echo "failed or cut: $2" >> "$LOG"
    return 0
  fi
  # shellcheck disable=SC2086  # EVAL_ARGS is a list of flags
  timeout -k 10 "$left" "${VLA[@]}" eval --bundle "$1" --episodes "$5" --seed "$4" "${STEP_ARGS[@]}" $EVAL_ARGS \
    --noise-scale "$3" --no-plots --no-progress --report "$EVALS/$2/$4" >> "$LOG" 2>&1 || echo "failed or cut: $2 seed $4" >> "$LOG"
}
say "$(wc -l < "$order") slices of <= $SLICE episodes (${#names[@]} bundles x noise scales, $EPISODES each, seeds $SEED..) on $PROCS processes"
SECONDS_START=$SECONDS
while read -r b name noise seed n; do
  while [ "$(jobs -rp | wc -l)" -ge "$PROCS" ]; do wait -n; done
  run_slice "$b" "$name" "$noise" "$seed" "$n" &
done < "$order"
wait
say "slices done in $(( SECONDS - SECONDS_START )) s"

# -- the paired table and the archive -------------------------------------------------------------------
reports=()
for name in "${names[@]}"; do
  parts=$(ls -d "$EVALS/$name"/*/report.json 2>/dev/null | sort -V | xargs -r -n1 dirname | paste -sd, -)
  [ -n "$parts" ] && reports+=("$name=$parts")
  echo "$name: $(echo "$parts" | tr ',' '\n' | grep -c .) slices" >> "$SUMMARY"
done
if [ ${#reports[@]} -eq 0 ]; then
  say "FAILED: no slice wrote a report (the log's end:)"
  tail -n 20 "$LOG"
  echo "failed: no report" >> "$SUMMARY"
  exit 1
fi
"${VLA[@]}" bench outcomes "${reports[@]}" --by y >> "$SUMMARY" 2>&1
for f in "${firsts[@]}"; do
  "$PY" -c 'import json, sys
fc = json.load(open(sys.argv[2]))["modes"]["baseline"]["open_loop_error"]["first_chunk"]
num = lambda v: "-" if v is None else "%.3f" % v
print("%s: first chunks at tick 0 of %d demonstrations (noise 0): slope %s, corr %s, spread %.4f (the expert %.4f)"
      % (sys.argv[1], fc["demos"], num(fc["slope"]), num(fc["corr"]), fc["policy_spread"], fc["expert_spread"]))' \
    "$f" "$EVALS/first/first_$f/report.json" >> "$SUMMARY" 2>&1 \
    || echo "$f: no first-chunk check (run_eval.log)" >> "$SUMMARY"
done
tar -C "$EVALS" -czf "$OUTDIR/evals.tar.gz" --exclude='*.png' --exclude=lerobot .
say "done; $(ls "$OUTDIR" | tr '\n' ' ')"
cat "$SUMMARY"
