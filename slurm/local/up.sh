#!/usr/bin/env bash
# Bring up a Slurm cluster on this one machine (as root), from Debian's slurm-wlm and munge: munged, a
# slurm.conf, slurmctld, and one slurmd per emulated node. Each node gets this machine's CPUs and memory
# (as `slurmd -C` reports them). SLURM_LOCAL_NODES (default 2) slurmds pose as that many nodes, named
# merger-node1..N and resolved to 127.0.0.1 through /etc/hosts, so multi-node jobs (MASTER_ADDR on the first
# node, one torchrun per node) really run; SLURM_LOCAL_NODES=1 gives one node named after this host.
# Made for tests and laptops, not production: no cgroups (proctrack/linuxproc, task/none), so it runs inside
# containers, and no accounting database (`sacct` is disabled; `scontrol show job` reports job states).
# Idempotent: a cluster already up with these nodes is left as it is. Undo with slurm/local/down.sh.
set -euo pipefail

NODES=${SLURM_LOCAL_NODES:-2}
CONF=/etc/slurm/slurm.conf   # where Debian's sbatch/srun/squeue look without SLURM_CONF
LOGDIR=/var/log/slurm
HOSTS_MARK="# slurm/local nodes"
host=$(hostname -s)
if [ "$NODES" -eq 1 ]; then names=("$host"); else names=($(seq -f "merger-node%g" 1 "$NODES")); fi

cluster_up() {  # the controller answers and every node of ours is ready for jobs
    scontrol ping 2>/dev/null | grep -q "is UP" || return 1
    local ready
    ready=$(sinfo -h -N -o "%N %T" 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)/ {print $1}' | sort -u)
    [ "$ready" = "$(printf '%s\n' "${names[@]}" | sort -u)" ]
}

if cluster_up; then
    echo "slurm: already up (nodes ${names[*]})"
    exit 0
fi
for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "slurm: $tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
# Daemons left from another layout would keep serving the old nodes: start from scratch.
bash "$(dirname "$0")/down.sh" >/dev/null

# munge authenticates every Slurm message. As root, --force lets it start despite the ownership checks.
mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chmod 400 /etc/munge/munge.key
fi
munged --force

if [ "$NODES" -gt 1 ]; then
    echo "127.0.0.1 ${names[*]} $HOSTS_MARK" >> /etc/hosts
fi

mkdir -p /etc/slurm /var/spool/slurmctld "$LOGDIR"
hardware=$(slurmd -C | head -n1 | sed 's/^NodeName=[^ ]* //')
{
    cat <<CONF
# Written by slurm/local/up.sh: a test cluster on one machine.
ClusterName=merger-local
SlurmctldHost=${host}(127.0.0.1)
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
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=${LOGDIR}/slurmctld.log
SlurmdLogFile=${LOGDIR}/slurmd-%n.log
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    # Each slurmd listens on its own port; all traffic stays on the loopback interface.
    for i in "${!names[@]}"; do
        echo "NodeName=${names[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$((17001 + i)) $hardware State=UNKNOWN"
    done
} > "$CONF"

slurmctld
for name in "${names[@]}"; do
    mkdir -p "/var/spool/slurmd/$name"
    slurmd -N "$name"
done

# A node left DOWN by an earlier run does not come back by itself: resume it.
for _ in $(seq 60); do
    cluster_up && { echo "slurm: up (nodes ${names[*]}, partition debug)"; exit 0; }
    for name in $(sinfo -h -N -t down,drain -o %N 2>/dev/null); do
        scontrol update nodename="$name" state=resume 2>/dev/null || true
    done
    sleep 0.5
done
echo "slurm: the nodes did not become idle; see $LOGDIR/slurmctld.log and $LOGDIR/slurmd-*.log" >&2
sinfo -N >&2 || true
exit 1
