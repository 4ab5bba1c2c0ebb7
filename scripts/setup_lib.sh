# Sourced by scripts/setup.sh and scripts/setup_engines.sh: one virtualenv, built in named steps.
#
# - Before anything: Python 3.11 (the local torch 2.13.0 CPU file is cp311) and enough free disk, else one line.
# - Each step prints what it does; a failing step prints ONE line (which step, what to do) and exits 1.
# - Interrupted at any point (Ctrl-C, kill -9 in the middle of pip): the virtualenv carries a marker from its
#   first byte until its last step is done, so running the same command again finds the marker, removes the
#   half-built virtualenv and builds it again (quick with pip's cache). A finished virtualenv is reused as long
#   as the stamp (a hash of its requirement files and scripts) matches.

PY=${PYTHON:-python3}
SETUP_NAME=$(basename "$0")

fail() {  # fail STEP HINT: the one line a user reads
  echo "$SETUP_NAME: step '$1' failed: $2" >&2
  exit 1
}

check_python() {
  command -v "$PY" >/dev/null 2>&1 || fail "find python" "no '$PY' on PATH: install Python 3.11 or set PYTHON=/path/to/python3.11"
  local v
  v=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || fail "find python" "'$PY' does not run"
  [ "$v" = "3.11" ] || fail "check python" "'$PY' is Python $v; eaglepipe needs 3.11 (its torch 2.13.0 CPU build is cp311): set PYTHON=/path/to/python3.11"
}

check_disk() {  # check_disk MiB: free space where the virtualenv goes (pip's cache and temp files included)
  local free
  free=$("$PY" -c 'import shutil; print(shutil.disk_usage(".").free // 2**20)')
  [ "$free" -ge "$1" ] || fail "check disk" "$(pwd) has ${free} MiB free, $VENV needs about $1 MiB: free some space and run the same command again"
}
# venv_begin VENV WANT_STAMP: returns 1 if VENV is complete and up to date (nothing to do), else prepares it
venv_begin() {
  VENV=$1
  WANT=$2
  if [ -f "$VENV/.eaglepipe-incomplete" ]; then
    echo "$SETUP_NAME: $VENV was left half-built by an interrupted set-up: removing it and building it again"
    rm -rf "$VENV"
  elif [ -d "$VENV" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "$SETUP_NAME: $VENV has no working python: removing it and building it again"
    rm -rf "$VENV"
  fi
  if [ -d "$VENV" ] && [ "$(cat "$VENV/.eaglepipe-deps" 2>/dev/null)" = "$WANT" ]; then
    return 1
  fi
  STEP_N=0
  mkdir -p "$VENV"
  touch "$VENV/.eaglepipe-incomplete"
  rm -f "$VENV/.eaglepipe-deps"
  return 0
}
step() {  # step NAME HINT CMD...: run CMD; on failure one line naming the step and what to do
  local name=$1 hint=$2
  shift 2
  STEP_N=$((STEP_N + 1))
  echo "$SETUP_NAME: [$STEP_N] $name"
  # this machine's pip config names local index folders that do not all exist: pip warns once per package
  "$@" 2> >(grep -v "^WARNING: Location 'file://.*' is ignored: it is neither a file nor a directory" >&2) \
    || fail "$name" "$hint (exit $?)"
}
venv_done() {
  echo "$WANT" > "$VENV/.eaglepipe-deps"
  rm -f "$VENV/.eaglepipe-incomplete"
  echo "$SETUP_NAME: $VENV ready ($(du -sh "$VENV" | cut -f1))"
}
NET_HINT="pip could not install it (its message is above): check that PyPI is reachable (a proxy? offline?) and that the disk is not full, then run the same command again"
