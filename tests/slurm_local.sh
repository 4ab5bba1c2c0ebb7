#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying and testing eaglepipe's cluster path for real (issue #38).
#
#   tests/slurm_local.sh up       # install (Debian, as root) when missing, configure, start, wait until idle
#   tests/slurm_local.sh status   # exit 0 when all three daemons run and the node answers; 1 otherwise
#   tests/slurm_local.sh down     # cancel this cluster's jobs, stop exactly the daemons `up` started
#   eval "$(tests/slurm_local.sh env)"   # SLURM_CONF for sbatch/srun/sinfo in this shell
#
# Everything lives in one state directory, ${EAGLEPIPE_SLURM_DIR:-/tmp/eaglepipe-slurm}: the munge key and
# socket, slurm.conf (the node sized from `slurmd -C`: this host's name, CPUs, memory), the controller's state,
# the daemons' pid files and logs. Nothing in /etc is written: the clients find the cluster through SLURM_CONF.
# Its own munged (own socket) runs beside any system munge. `up` is idempotent (a running cluster is kept) and
# after a crash it stops what is left of its own daemons, by their pid files, and starts from clean state.
# Ports: EAGLEPIPE_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd). EAGLEPIPE_SLURM_CPUS declares
# the node with that many CPUs instead of its cores (the tests' jobs, mostly Python start-up and SLURM's own
# delays, then overlap instead of queueing for 2 cores).
set -euo pipefail

DIR=${EAGLEPIPE_SLURM_DIR:-/tmp/eaglepipe-slurm}
PORT=${EAGLEPIPE_SLURM_PORT:-6817}
CONF=$DIR/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)
DAEMONS=(slurmd slurmctld munged)  # stopped in this order, started in the reverse one
export SLURM_CONF=$CONF

die() { echo "slurm_local: $*" >&2; exit 1; }
say() { echo "slurm_local: $*" >&2; }

pidfile() {
  case $1 in
    munged) echo "$DIR/munge/munged.pid" ;;
    *) echo "$DIR/$1.pid" ;;
  esac
}

# The pid in $1's pid file when that process runs and is that daemon (a reused pid is not ours); else nothing.
ours() {
  local f pid
  f=$(pidfile "$1")
  [[ -s $f ]] || return 1
  pid=$(tr -dc '0-9' <"$f")
  [[ -n $pid && -r /proc/$pid/comm ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] || return 1
  [[ ! $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) =~ ^[ZX]$ ]] || return 1  # dead, not yet reaped
  echo "$pid"
}

install_packages() {
  local missing=()
  command -v munged >/dev/null || missing+=(munge)
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  ((${#missing[@]})) || return 0
  [[ $(id -u) == 0 ]] || die "${missing[*]} not installed; as root: apt-get install -y ${PACKAGES[*]}"
  command -v apt-get >/dev/null || die "${missing[*]} not installed and no apt-get here: install SLURM and munge"
  say "installing ${missing[*]} (apt-get)"
  local log=$DIR/apt.log
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >"$log" 2>&1; then
    apt-get update >>"$log" 2>&1 || true
    apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1 \
      || die "apt-get install ${PACKAGES[*]} failed; see $log"
  fi
}

write_conf() {
  local host node mem
  host=$(hostname -s)
  # `slurmd -C`: this node as slurmd sees it (CPUs, sockets, cores, threads, memory); fall back to nproc/meminfo
  node=$(slurmd -C 2>/dev/null | grep '^NodeName=' || true)
  if [[ -z $node ]]; then
    mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    node="NodeName=$host CPUs=$(nproc) RealMemory=$mem"
  fi
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
  mem=$((mem * 95 / 100))  # headroom: never "Low RealMemory"
  node=$(sed "s/RealMemory=[0-9]*/RealMemory=$mem/" <<<"$node")
  local overrides=""
  if [[ -n ${EAGLEPIPE_SLURM_CPUS:-} ]]; then  # more CPUs than cores: jobs share them (config_overrides keeps
    node="NodeName=$host CPUs=$EAGLEPIPE_SLURM_CPUS RealMemory=$mem"  # slurmd from draining
    overrides="SlurmdParameters=config_overrides"  # the node for having fewer than declared)
  fi
  cat >"$CONF" <<EOF
# written by tests/slurm_local.sh up: a one-node cluster on $host (state in $DIR)
ClusterName=eaglepipe
SlurmctldHost=$host
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (cred_expire + 1 s; SLURM's
# default is 120 s, its minimum 5). The wait keeps a restart from being refused on the revoked credential of
# the run it replaces: starting it sooner (scontrol update StartTime=now) failed a restart in the same
# second, exit 1.
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=5
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$(pidfile slurmctld)
SlurmdPidFile=$(pidfile slurmd)
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# the scheduler's pass over pending jobs every second (60 s by default): a requeued job starts when its wait ends
SchedulerParameters=sched_interval=1
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
# a job's processes keep the nice value of the sbatch (and the srun) that started them: work submitted with
# `nice` yields the cores to work submitted without (the tests run their side runs so, beside the chain)
PropagatePrioProcess=1
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
MailProg=/bin/true
$overrides
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  local key=$DIR/munge/munge.key
  if [[ ! -s $key ]]; then
    dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
  fi
  chmod 0400 "$key"
  rm -f "$DIR/munge/munge.socket.2" "$DIR/munge/munge.socket.2.lock"
  munged --force --key-file="$key" --socket="$DIR/munge/munge.socket.2" --pid-file="$(pidfile munged)" \
    --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" 9>&- \
    || die "munged did not start; see $DIR/munge/munged.log"
}

# Stop one of our daemons by its pid file: TERM, then KILL after 10 s. A pid that is not that daemon is left alone.
stop() {  # the daemons named, SIGTERM to all at once (each takes ~2 s to exit), SIGKILL to any left after 10 s
  local d pid
  local -A pids=()
  for d in "$@"; do
    if pid=$(ours "$d"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids[$d]=$pid
    fi
  done
  for d in "$@"; do
    if [[ -n ${pids[$d]:-} ]]; then
      pid=${pids[$d]}
      for _ in $(seq 100); do
        [[ -d /proc/$pid ]] || break
        sleep 0.1
      done
      if [[ -d /proc/$pid ]]; then
        say "$d (pid $pid) did not stop on SIGTERM: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
      fi
      say "stopped $d (pid $pid)"
    fi
    rm -f "$(pidfile "$d")"
  done
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -1; }

running() {
  local d
  for d in "${DAEMONS[@]}"; do ours "$d" >/dev/null || return 1; done
  [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]
}

wait_idle() {
  local state=""
  for _ in $(seq 120); do
    state=$(node_state)
    [[ $state == idle ]] && return 0
    if [[ $state =~ ^(down|drain|drained|fail) ]]; then
      scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
  done
  die "the node did not become idle within 60 s (state: ${state:-no answer}); see $DIR/slurmctld.log and $DIR/slurmd.log"
}

up() {
  install_packages
  if running; then
    say "up already (state $DIR): $(node_state)"
    return 0
  fi
  local d
  stop "${DAEMONS[@]}"  # what a crash left of ours
  rm -rf "$DIR/ctld" "$DIR/spool"  # stale controller state: jobs of a cluster that is gone
  mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool"
  chmod 0700 "$DIR/munge"
  write_conf
  start_munge
  # 9>&-: the daemons must not inherit the lock of this up/down (they would hold it for their lifetime)
  slurmctld -f "$CONF" -c -i 9>&- || die "slurmctld did not start; see $DIR/slurmctld.log"
  slurmd -f "$CONF" 9>&- || die "slurmd did not start; see $DIR/slurmd.log"
  wait_idle
  say "up (state $DIR; export SLURM_CONF=$CONF):"
  sinfo -N -l >&2
}

down() {
  if ours slurmctld >/dev/null; then
    local jobs
    jobs=$(squeue -h -o '%i' 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      say "cancelling this cluster's jobs: $(echo $jobs)"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 50); do
        [[ -z $(squeue -h -o '%i' 2>/dev/null) ]] && break
        sleep 0.2
      done
    fi
  fi
  stop "${DAEMONS[@]}"
}

status() {
  local d pid rc=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(ours "$d"); then echo "$d: running (pid $pid)"; else echo "$d: not running"; rc=1; fi
  done
  if ((rc == 0)); then
    sinfo -N -o '%N %T %c %m' || rc=1
  fi
  return $rc
}

mkdir -p "$DIR"
case ${1:-} in
  up | down)
    exec 9>"$DIR/.lock"
    flock -w 120 9 || die "another up/down holds $DIR/.lock for 120 s"  # one at a time (two test sessions)
    "$1"
    ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 up|down|status|env" ;;
esac
