#!/usr/bin/env bash
# Take down the cluster slurm/local/up.sh started in DIR: cancel its jobs, stop its slurmds, slurmctld and
# munged by the pid files in DIR, and remove its state (DIR/log stays, for a post-mortem). Only daemons whose
# command line names DIR are stopped: a pid file left stale and reused by another process is ignored, and
# no other Slurm or munge on the machine is touched. Idempotent.
#
#   slurm/local/down.sh [DIR]                # DIR: $SLURM_LOCAL_DIR, else /tmp/merger-slurm
set -uo pipefail

DIR=$(realpath -m "${1:-${SLURM_LOCAL_DIR:-/tmp/merger-slurm}}")
export SLURM_CONF=$DIR/slurm.conf

stop() {  # stop <pidfile>: TERM the daemon of DIR that wrote it and wait until it is gone
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    if [[ $pid =~ ^[0-9]+$ ]] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/"; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    rm -f "$1"
}

# Job steps outlive slurmd (no cgroups here): cancel the jobs while the daemons can still end them.
if [ -f "$SLURM_CONF" ] && scontrol ping 2>/dev/null | grep -q "is UP"; then
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
        scancel $jobs 2>/dev/null
        for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
fi
for pidfile in "$DIR"/run/slurmd-*.pid; do stop "$pidfile"; done
stop "$DIR/run/slurmctld.pid"
stop "$DIR/munge/munged.pid"
rm -rf "$DIR/slurm.conf" "$DIR/plugstack.conf" "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/run"
echo "slurm: down ($DIR)"
