#!/usr/bin/env bash
# Take down the single-node cluster of slurm/local/up.sh: stop slurmd, slurmctld and munged by their pid
# files and remove the config it wrote. Jobs still running are killed with the daemons. Idempotent.
set -uo pipefail

stop() {  # stop <pidfile>: TERM the daemon and wait until it is gone
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    rm -f "$1"
}

stop /run/slurmd.pid
stop /run/slurmctld.pid
stop /run/munge/munged.pid
rm -f /etc/slurm/slurm.conf
echo "slurm: down"
