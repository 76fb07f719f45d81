# Sourced by the scripts that run on a lent GPU machine (gpu_record_train.sh, gpu_eval.sh), after
# their own settings (STEPS, LOG_NAME, T0): the shared settings' defaults, the log and the summary started,
# say() to log a line, the packages and EGL loaders of CARRY (what scripts/gpu_carry.sh built) made
# usable, MuJoCo set to render through EGL, VLA the package's command line, STEP_ARGS its --steps.
PY=${PY:-python3}
OUTDIR=${OUTDIR:-${OUT:-gpu_out}}   # what comes back
CARRY=${CARRY:-.gpucarry}           # what scripts/gpu_carry.sh built here
WORKDIR=${WORKDIR:-gpu_work}        # bags, runs, evaluations: stays there
mkdir -p "$OUTDIR" "$WORKDIR"
LOG=$OUTDIR/$LOG_NAME
SUMMARY=$OUTDIR/summary.txt
say() { echo "[$(( SECONDS - T0 )) s] $*" | tee -a "$LOG"; }
: > "$SUMMARY"
STEP_ARGS=()
[ "$STEPS" -gt 0 ] && STEP_ARGS=(--steps "$STEPS")
if [ -d "$CARRY/gl" ] && ls "$CARRY"/gl/*.deb >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  for f in "$CARRY"/gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
NV_EGL=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
[ -f "$NV_EGL" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$NV_EGL
if [ -f "$CARRY/site.tar.xz" ]; then
  # A second call on the same machine finds the packages unpacked by the first.
  [ -f /tmp/gpu_site/.unpacked ] || { mkdir -p /tmp/gpu_site && tar -xJf "$CARRY/site.tar.xz" -C /tmp/gpu_site && touch /tmp/gpu_site/.unpacked; }
  export PYTHONPATH=/tmp/gpu_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export MUJOCO_GL=egl PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
VLA=("$PY" -m vla_accel_ros.cli)
say "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1)"
