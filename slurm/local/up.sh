#!/usr/bin/env bash
# Bring up a single-node Slurm cluster on this machine (as root), from Debian's slurm-wlm and munge:
# munged, a slurm.conf describing this machine (CPUs and memory as `slurmd -C` reports them), slurmctld and
# slurmd. Made for tests and laptops, not production: no cgroups (proctrack/linuxproc, task/none), so it runs
# inside containers, and no accounting database (`sacct` is disabled; `scontrol show job` reports states).
# Idempotent: a cluster that is already up is left as it is. Undo with slurm/local/down.sh.
set -euo pipefail

CONF=/etc/slurm/slurm.conf   # where Debian's sbatch/srun/squeue look without SLURM_CONF
LOGDIR=/var/log/slurm

cluster_up() {
    scontrol ping 2>/dev/null | grep -q "is UP" &&
        sinfo -h -N -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}

if cluster_up; then
    echo "slurm: already up"
    exit 0
fi
for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "slurm: $tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done

# munge authenticates every Slurm message. As root, --force lets it start despite the ownership checks.
mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chmod 400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    munged --force
fi

node=$(hostname -s)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGDIR"
# The node line is this machine's own hardware; NodeAddr keeps all traffic on the loopback interface.
cat > "$CONF" <<CONF
# Written by slurm/local/up.sh: a one-node test cluster.
ClusterName=merger-local
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOGDIR}/slurmctld.log
SlurmdLogFile=${LOGDIR}/slurmd.log
$(slurmd -C | head -n1) NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

scontrol ping 2>/dev/null | grep -q "is UP" || slurmctld
[ -f /run/slurmd.pid ] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null || slurmd

# A node left DOWN by an earlier run does not come back by itself: resume it.
for _ in $(seq 60); do
    cluster_up && { echo "slurm: up (node $node, partition debug)"; exit 0; }
    state=$(sinfo -h -N -o %T 2>/dev/null || true)
    case "$state" in down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;; esac
    sleep 0.5
done
echo "slurm: the node did not become idle; see $LOGDIR/slurmctld.log and $LOGDIR/slurmd.log" >&2
sinfo -N >&2 || true
exit 1
