#!/usr/bin/env bash
# Take down the cluster of slurm/local/up.sh: stop every slurmd, slurmctld and munged by their pid files,
# and remove the config and the /etc/hosts line it wrote. Jobs still running die with the daemons. Idempotent.
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

for pidfile in /run/slurmd-*.pid /run/slurmd.pid; do stop "$pidfile"; done
stop /run/slurmctld.pid
stop /run/munge/munged.pid
rm -f /etc/slurm/slurm.conf
if grep -q "# slurm/local nodes" /etc/hosts 2>/dev/null; then
    grep -v "# slurm/local nodes" /etc/hosts > /etc/hosts.slurm-local && cat /etc/hosts.slurm-local > /etc/hosts
    rm -f /etc/hosts.slurm-local
fi
echo "slurm: down"
