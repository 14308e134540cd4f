#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, for CI and the tests in tests/test_slurm.py.
#
#   bash scripts/slurm-localhost.sh start   # install (Debian/apt, root) if needed, configure, start, wait until srun works
#   bash scripts/slurm-localhost.sh stop    # stop slurmd, slurmctld and munged
#
# Both are idempotent. No systemd is needed (CI runs in a plain Debian 12 container): the daemons are started by
# hand and daemonize themselves. Logs and state live in $SLURM_LOCALHOST_DIR (default /tmp/slurm-localhost); the
# config goes to /etc/slurm, the default path, so that srun/sbatch/sinfo find it without SLURM_CONF.
set -euo pipefail

DIR=${SLURM_LOCALHOST_DIR:-/tmp/slurm-localhost}
HOST=$(uname -n); HOST=${HOST%%.*}  # slurmd finds its NodeName from the short hostname (no `hostname` in slim images)
# Declare at least 16 CPUs even on a 2-core machine, so that jobs with more tasks than cores (e.g. 4 ranks of a test)
# still fit; `SlurmdParameters=config_overrides` stops slurmd from draining the node for having fewer real cores.
CPUS=$(( $(nproc) > 16 ? $(nproc) : 16 ))

log_tails() {
  for f in "$DIR"/slurmctld.log "$DIR"/slurmd.log /var/log/munge/munged.log "$DIR"/munged.stderr "$DIR"/check.log; do
    [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 20 "$f" >&2; }
  done
  return 0
}
die() { echo "slurm-localhost: $*" >&2; log_tails; exit 1; }

write_config() {
  mkdir -p /etc/slurm "$DIR/state" "$DIR/slurmd" "$DIR/new"
  # No cgroups, no accounting, no systemd: proctrack/linuxproc and task/none work in an unprivileged container.
  # SlurmctldHost/NodeAddr pin everything to 127.0.0.1, so no DNS entry for the hostname is needed.
  # ReturnToService=2 brings the node back after a restart instead of leaving it DOWN ("unexpectedly rebooted").
  # MinJobAge=4: `sbatch --wait` polls every 2 s instead of backing off to 2, 10, 42 s (it polls more often than
  # finished jobs are purged); finished jobs still stay visible for about a minute (slurmctld purges periodically).
  cat > "$DIR/new/slurm.conf" <<CONF
ClusterName=localhost
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=4
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
  # slurmd always loads a cgroup plugin, which by default detects the cgroup version from /sys/fs/cgroup and fails
  # in containers (read-only cgroup v2, no /sys, ...). Naming v1 skips the detection, and as no cgroup-based plugin
  # is configured above, it then touches no cgroup files at all (checked in a chroot without /sys).
  echo "CgroupPlugin=cgroup/v1" > "$DIR/new/cgroup.conf"
  if ! cmp -s "$DIR/new/slurm.conf" /etc/slurm/slurm.conf || ! cmp -s "$DIR/new/cgroup.conf" /etc/slurm/cgroup.conf; then
    stop_slurm  # daemons running with another config would not pick the new one up
    mv "$DIR/new/slurm.conf" "$DIR/new/cgroup.conf" /etc/slurm/
  fi
  rm -rf "$DIR/new"
}

# Is this daemon running, per its pid file? Read from /proc: slim images have no ps/pgrep. A stopped daemon can
# linger as a zombie (some container inits reap late), and a stale pid file can name a reused pid: check for both.
alive() {
  local pid; pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat")" != Z ]
}

stop_slurm() {
  for d in slurmd slurmctld; do
    if alive $d; then
      kill "$(cat "$DIR/$d.pid")"
      for _ in $(seq 50); do alive $d || break; sleep 0.2; done
    fi
    rm -f "$DIR/$d.pid"
  done
}

start() {
  [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and runs slurmd, which launches jobs as any user)"
  mkdir -p "$DIR"
  if ! command -v srun >/dev/null || ! command -v slurmd >/dev/null || ! command -v slurmctld >/dev/null; then
    echo "slurm-localhost: installing slurm and munge with apt-get (log: $DIR/apt.log)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge; } \
      >"$DIR/apt.log" 2>&1 || { tail -n 20 "$DIR/apt.log" >&2; die "apt-get failed"; }
  fi
  write_config

  # munge authenticates every Slurm RPC. It needs a key readable only by the munge user, and its socket directory;
  # --force: start anyway over a stale socket (after an unclean stop) or loose directory permissions (containers).
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- munged --force 2>>"$DIR/munged.stderr" || die "munged did not start"
    munge -n | unmunge >/dev/null || die "munge does not work"
  fi

  # Both daemonize themselves. -c: start from a clean slate, without the jobs and node state of an earlier run.
  # (Their stderr, mostly harmless hardware-probing noise, goes to the logs too.)
  alive slurmctld || slurmctld -c 2>>"$DIR/slurmctld.log" || die "slurmctld did not start"
  alive slurmd || slurmd 2>>"$DIR/slurmd.log" || die "slurmd did not start"

  # Wait until the node has registered and a real job step runs end to end. The client commands retry for a while
  # when slurmctld is unreachable, hence the timeouts on each and a deadline on the whole.
  local state="" deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ]; do
    state=$(timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*|completing*)
        if timeout 30 srun -N1 -n1 true 2>"$DIR/check.log"; then echo "slurm-localhost: up ($HOST, $CPUS CPUs, logs in $DIR)"; return 0; fi ;;
      down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
  done
  die "not ready after 60 s (node state: '${state:-unknown}')"
}

case "${1:-}" in
  start) start ;;
  stop) stop_slurm; munged --stop >/dev/null 2>&1 || true; echo "slurm-localhost: stopped" ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
