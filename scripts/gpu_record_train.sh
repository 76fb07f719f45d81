#!/usr/bin/env bash
# One call on a lent GPU machine (many cores, PyTorch installed, no network, a deadline): record
# scripted demonstrations on every core, train one SmolVLA run on them until the deadline, and
# pack the bundles it kept into parts small enough to come back. Run from the repository root:
#
#   CARRY=.gpucarry OUTDIR=$OUT scripts/gpu_record_train.sh
#
# CARRY is what scripts/gpu_carry.sh built here (site.tar.xz, gl/*.deb); without it the packages
# must be importable already. Everything is an environment variable with a default (below), so
# a dry run on a CPU machine is the same script (scripts/README.md). Unpack what came back with
#   for b in final step_a step_b; do mkdir -p runs/$b && cat OUTDIR/$b.tar.* | tar -xf - -C runs/$b; done
#
# Lessons of earlier calls, each cost most of a call once (docs/policy-experiments.md):
#  - every recorder runs under `timeout`, and only bags with their metadata.yaml are trained on
#    (a recorder that hangs at interpreter exit must not hold the call);
#  - no `exec > >(tee ...)`: a bare `wait` also waits for that process substitution, which ends
#    only with the script. The log is appended to, and `wait` names its processes;
#  - one training run on every core, the bags read once by as many processes as there are cores.
set -u
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-570}          # the whole script, from its start; the call's limit is above it
RECORD_S=${RECORD_S:-200}              # no bag is started after this; each process records one at least (0: record nothing, train on WORKDIR/data)
PACK_S=${PACK_S:-30}                   # kept for packing after training
PROCS=${PROCS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}
TASK=${TASK:-transfer_cube}
CAMERAS=${CAMERAS:-top,left_wrist,right_wrist}
RENDER_EVERY=${RENDER_EVERY:-4}
# Also every tick before this one (sim record --render-first): 1 renders each episode's tick 0, the arm at home
# on every seed, which the phase of --render-every leaves to 1 episode in 4; later ticks show the arm's
# first motion, which a policy learns to follow instead of the cube (docs/policy-experiments.md).
RENDER_FIRST=${RENDER_FIRST:-1}
# Tick-0 scenes besides: short demonstrations that render tick 0 alone and record the chunk of actions
# after it (sim record --render-every 0 --render-first 1), each process one bag of them before its
# whole episodes. One render each, so thousands cost a minute, where whole episodes give one tick-0
# frame in ~75; on the CPU the first chunk began to follow the cube with more such scenes.
SCENES=${SCENES:-1500}                 # in all, split over the processes (0: none)
SCENE_STEPS=${SCENE_STEPS:-50}         # actions after each tick-0 frame: the policy's chunk
SCENE_SEED0=${SCENE_SEED0:-200000}     # process p: seeds SCENE_SEED0 + 10000 p onwards
EPISODES_PER_BAG=${EPISODES_PER_BAG:-4}
STEPS=${STEPS:-0}                      # control steps per episode (0: the task's)
SEED0=${SEED0:-130000}                 # process p, bag k: seed SEED0 + 1000 p + EPISODES_PER_BAG k (used: 1000, 30000, 50000, 70000, 110000)
VAL_SEED=${VAL_SEED:-91000}            # recorded without noise: val losses comparable between calls
ACTION_NOISE=${ACTION_NOISE:-0.02}     # training bags: rad of held command noise, the label the expert's (sim record --action-noise)
NOISE_HOLD=${NOISE_HOLD:-25}
# Recovery demonstrations (sim record --detour FIRST,LAST: the right arm first heads for a decoy, then turns
# to the cube; frames from the turn on). Each process records, in turn, WHOLE bags of whole episodes, then
# DETOURS bags of detours (no command noise on these: a recording takes one or the other). On the CPU, 160
# detours moved the near side of the cube's range (50/100 against 38/100 on one block of seeds, 132/300
# against 121/300 on three; docs/policy-experiments.md). DETOURS=0: whole episodes only.
DETOUR=${DETOUR:-10,45}
WHOLE=${WHOLE:-1}
DETOURS=${DETOURS:-2}
if [ $(( WHOLE + DETOURS )) -lt 1 ]; then
  echo "WHOLE=$WHOLE DETOURS=$DETOURS: each process records WHOLE bags of whole episodes, then DETOURS of detours; at least one must be above 0" >&2
  exit 2
fi
VAL_EPISODES=${VAL_EPISODES:-8}
BAG_TIMEOUT=${BAG_TIMEOUT:-$(( 60 * EPISODES_PER_BAG + 60 ))}
DEVICE=${DEVICE:-cuda}
INIT_FROM=${INIT_FROM:-bundles/transfer_cube-smolvla}
# 1: train with INIT_FROM's normalization statistics (train --init-norm): the tick-0 scenes' actions,
# the reach alone, would shift the data's by up to 0.8 std and so move every output of the start.
INIT_NORM=${INIT_NORM:-1}
RUN=${RUN:-run}
TRAIN_ARGS=${TRAIN_ARGS:---family smolvla --size mini --cameras cam_high,cam_left_wrist,cam_right_wrist --image-size 512 --patch-size 64 --no-state --batch 128 --lr 1e-4 --warmup-steps 100 --epochs 100 --threads 2 --loader-threads 6 --checkpoint-every 250 --keep-every 250}
TRAIN_EXTRA=${TRAIN_EXTRA:-}           # appended to TRAIN_ARGS: a later flag overrides an earlier one
# The training frames unpacked onto the GPU once (train --device-frames-gib): the host assembling and
# copying 300 MB a step left an H200 half idle. All of its memory but 40 GiB (the run held 18 GiB at
# batch 128; the rest for the batches assembled ahead); above that they stay packed on the host.
if [ -z "${DEVICE_FRAMES_GIB:-}" ]; then
  DEVICE_FRAMES_GIB=0
  if [ "$DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2> /dev/null | head -n 1)
    case "$mib" in '' | *[!0-9]*) ;; *) DEVICE_FRAMES_GIB=$(( mib / 1024 > 40 ? mib / 1024 - 40 : 0 )) ;; esac
  fi
fi

LOG_NAME=run.log

# -- the environment -----------------------------------------------------------------------------
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
INIT=()
[ -n "$INIT_FROM" ] && INIT=(--init-from "$INIT_FROM")
[ -n "$INIT_FROM" ] && [ "$INIT_NORM" = 1 ] && INIT+=(--init-norm)
record() {  # SEED EPISODES OUT [NOISE [DETOUR]]: one bag, under a timeout, its output in the log
  local detour=()
  [ -n "${5:-}" ] && detour=(--detour "$5")
  timeout -k 10 "$BAG_TIMEOUT" "${VLA[@]}" sim record --task "$TASK" --episodes "$2" --seed "$1" \
    --cameras "$CAMERAS" --render-every "$RENDER_EVERY" --render-first "$RENDER_FIRST" "${STEP_ARGS[@]}" --action-noise "${4:-0}" \
    --noise-hold "$NOISE_HOLD" "${detour[@]}" --out "$3" >> "$LOG" 2>&1
}
SCENES_PER_PROC=$(( (SCENES + PROCS - 1) / PROCS ))
record_scenes() {  # SEED OUT: one bag of tick-0 scenes
  timeout -k 10 $(( 2 * SCENES_PER_PROC + 60 )) "${VLA[@]}" sim record --task "$TASK" --episodes "$SCENES_PER_PROC" --seed "$1" \
    --cameras "$CAMERAS" --steps "$SCENE_STEPS" --render-every 0 --render-first 1 --out "$2" >> "$LOG" 2>&1
}

# -- recording ---------------------------------------------------------------------------------------
DATA=$WORKDIR/data
if [ "$RECORD_S" -gt 0 ]; then
  rm -rf "$DATA" "$WORKDIR/stop" && mkdir -p "$DATA"  # stop: the recorders' signal, left by a failed call
  # One short episode first: a machine that cannot render (or lacks a package) fails here, in seconds,
  # not after minutes of recorders that all fail.
  if ! timeout 120 "${VLA[@]}" sim record --task "$TASK" --episodes 1 --seed 1 --steps 8 --cameras "$CAMERAS" \
      --out "$WORKDIR/probe" >> "$LOG" 2>&1; then
    tail -n 20 "$LOG"
    say "FAILED: a one-episode probe recording failed (the log's end above): the simulator, its EGL context or a package does not work here; nothing recorded"
    echo "failed: render probe" >> "$SUMMARY"
    exit 1
  fi
  # One training step on the probe bag, beside the recorders: a trainer that cannot run here (a
  # package, the GPU, the initial bundle) stops the call in a minute, with most of the device
  # time left for a second call after the fix, not after minutes of recording.
  # shellcheck disable=SC2086  # TRAIN_ARGS and TRAIN_EXTRA are lists of flags
  timeout -k 10 240 "${VLA[@]}" train $TRAIN_ARGS $TRAIN_EXTRA --data "$WORKDIR/probe" --val-episodes 0 --max-steps 1 \
    --device "$DEVICE" --device-frames-gib "$DEVICE_FRAMES_GIB" "${INIT[@]}" --out "$WORKDIR/smoke" > "$WORKDIR/smoke.log" 2>&1 &
  smoke=$!
  END=$(( T0 + RECORD_S ))
  pids=()
  record "$VAL_SEED" "$VAL_EPISODES" "$DATA/val" &
  pids+=($!)
  for p in $(seq 0 $(( PROCS - 1 ))); do
    (
      [ "$SCENES" -gt 0 ] && [ ! -f "$WORKDIR/stop" ] && record_scenes $(( SCENE_SEED0 + 10000 * p )) "$DATA/scenes_p${p}"
      k=0
      while [ ! -f "$WORKDIR/stop" ]; do  # at least one bag each, then none started after RECORD_S
        seed=$(( SEED0 + 1000 * p + EPISODES_PER_BAG * k ))
        if [ $(( k % (WHOLE + DETOURS) )) -lt "$WHOLE" ]; then
          record "$seed" "$EPISODES_PER_BAG" "$DATA/p${p}_k${k}" "$ACTION_NOISE"
        else
          record "$seed" "$EPISODES_PER_BAG" "$DATA/p${p}_k${k}_detour" 0 "$DETOUR"
        fi
        k=$(( k + 1 ))
        [ $SECONDS -lt $END ] || break
      done
    ) &
    pids+=($!)
  done
  if ! wait "$smoke"; then
    touch "$WORKDIR/stop"
    for p in "${pids[@]}"; do pkill -P "$p"; done  # their recorders (timeout passes the signal on)
    wait "${pids[@]}"
    tr '\r' '\n' < "$WORKDIR/smoke.log" | grep -v 'step/s' | tail -n 25 | tee -a "$LOG"
    say "FAILED: one training step on the probe recording failed (its log's end above); recording stopped"
    echo "failed: training smoke" >> "$SUMMARY"
    exit 1
  fi
  say "one training step on the probe recording ran: $(grep -h '"bundle"' "$WORKDIR/smoke.log" | tail -1)"
  rm -rf "$WORKDIR/probe" "$WORKDIR/smoke"
  wait "${pids[@]}"
  # A bag is complete when its writer closed it (metadata.yaml); others are dropped.
  for b in "$DATA"/*/; do [ -f "$b/metadata.yaml" ] || { say "dropping incomplete bag $b"; rm -rf "$b"; }; done
fi
BAGS=$(ls -d "$DATA"/p*_k* 2>/dev/null | sort -V)
NBAGS=$(echo "$BAGS" | grep -c . || true)
NDETOUR=$(echo "$BAGS" | grep -c '_detour$' || true)
SCENE_BAGS=$(ls -d "$DATA"/scenes_p* 2>/dev/null | sort -V)
NSCENES=$(( $(echo "$SCENE_BAGS" | grep -c . || true) * SCENES_PER_PROC ))
successes=$(grep -h -o "[0-9]* successes" "$LOG" | awk '{s += $1} END {print s + 0}')
say "recorded: $NBAGS training bags of $EPISODES_PER_BAG episodes (command noise $ACTION_NOISE rad held $NOISE_HOLD ticks), $NDETOUR of them detours ($DETOUR), validation bag: $([ -f "$DATA/val/metadata.yaml" ] && echo yes || echo no); scripted successes (all bags, probe included): $successes"
say "tick-0 scenes: $NSCENES (of SCENES=$SCENES), $SCENE_STEPS actions each"
echo "bags $NBAGS x $EPISODES_PER_BAG, tick-0 scenes $NSCENES, recorded by $(( SECONDS - T0 )) s" >> "$SUMMARY"
if [ "$NBAGS" -eq 0 ] || [ ! -f "$DATA/val/metadata.yaml" ]; then
  say "FAILED: no training bag or no validation bag"
  exit 1
fi

# -- training ----------------------------------------------------------------------------------------
LEFT=$(( DEADLINE_S - (SECONDS - T0) - PACK_S ))
if [ "$LEFT" -lt 60 ]; then
  say "FAILED: $LEFT s left for training"
  exit 1
fi
FIT=$(awk -v s="$LEFT" 'BEGIN {printf "%.2f", (s - 20) / 60}')  # 20 s: imports and the last checkpoint
say "training for $FIT min (--fit-minutes counts the reading of the bags)"
# shellcheck disable=SC2086  # TRAIN_ARGS and TRAIN_EXTRA are lists of flags
timeout -k 10 "$(( LEFT + 10 ))" "${VLA[@]}" train $TRAIN_ARGS $TRAIN_EXTRA --data $BAGS $SCENE_BAGS "$DATA/val" --val-episodes "$VAL_EPISODES" \
  --fit-minutes "$FIT" --device "$DEVICE" --device-frames-gib "$DEVICE_FRAMES_GIB" --read-workers "$PROCS" "${INIT[@]}" --out "$WORKDIR/$RUN" >> "$LOG" 2>&1
rc=$?
say "training ended with status $rc"
echo "train status $rc at $(( SECONDS - T0 )) s" >> "$SUMMARY"
tr '\r' '\n' < "$LOG" | grep -E '^training |^stopped|^frames:|fit|"bundle"' | grep -v 'step/s' | tail -n 8 >> "$SUMMARY"

# -- packing -----------------------------------------------------------------------------------------
# At most 8 files of 16 MiB come back: the final bundle and the two latest kept steps, each a tar
# cut into 15 MiB parts (a SmolVLA bundle is ~18 MB), plus this log and the summary.
pack() {  # BUNDLE_DIR NAME
  [ -f "$1/model.safetensors" ] || return 0
  tar -C "$1" -cf - --exclude=checkpoint --exclude=steps . | split -b 15M -d - "$OUTDIR/$2.tar."
  echo "packed $2 <- $1" >> "$SUMMARY"
}
pack "$WORKDIR/$RUN" final
mapfile -t kept < <(ls -d "$WORKDIR/$RUN"/steps/* 2>/dev/null | sort -V | tail -n 2)
[ ${#kept[@]} -ge 1 ] && pack "${kept[-1]}" step_b
[ ${#kept[@]} -ge 2 ] && pack "${kept[0]}" step_a
say "done; $(ls "$OUTDIR" | tr '\n' ' ')"
exit "$rc"
