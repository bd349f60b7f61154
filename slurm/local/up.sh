#!/usr/bin/env bash
# Bring up a Slurm cluster on this one machine (as root), from Debian's slurm-wlm and munge, that lives in one
# folder of its own: its slurm.conf, munge key and munged socket, state, spool, pid and log files are all in
# DIR. Nothing under /etc, /run or /var is written, and its ports (SLURM_LOCAL_PORT, default 16817, and the
# next one per node) are not Slurm's defaults, so it runs beside a real cluster without touching it.
#
#   slurm/local/up.sh [DIR]                  # DIR: $SLURM_LOCAL_DIR, else /tmp/merger-slurm
#   export SLURM_CONF=DIR/slurm.conf         # how sbatch/srun/squeue/scontrol find it
#   slurm/local/down.sh [DIR]                # stop its daemons, remove its state
#
# SLURM_LOCAL_NODES (default 2) slurmds pose as that many nodes, each with this machine's CPUs and memory (as
# `slurmd -C` reports them), so multi-node jobs (MASTER_ADDR on the first node, one torchrun per node) really
# run. A node's name is what jobs use as a host name, so each must resolve to this machine: they are taken
# from SLURM_LOCAL_NAMES if set, else from this host's short name, `localhost` and the other names
# /etc/hosts gives a loopback address (read, never written). All traffic goes over 127.0.0.1.
# Made for tests and laptops, not production: no cgroups (proctrack/linuxproc, task/none), so it runs inside
# containers, and no accounting database (`sacct` is disabled; `scontrol show job` reports job states).
# Idempotent: a cluster of DIR already up with these nodes is left as it is.
set -euo pipefail

DIR=$(realpath -m "${1:-${SLURM_LOCAL_DIR:-/tmp/merger-slurm}}")
NODES=${SLURM_LOCAL_NODES:-2}
PORT=${SLURM_LOCAL_PORT:-16817}
export SLURM_CONF=$DIR/slurm.conf
host=$(hostname -s)

is_local_address() {  # loopback, or one of this machine's own addresses
    case $1 in 127.*|::1) return 0 ;; esac
    [[ " $(hostname -I 2>/dev/null) " == *" $1 "* ]]
}

node_names() {  # the first $NODES names that resolve to this machine, one per line
    local candidates name addr
    if [ -n "${SLURM_LOCAL_NAMES:-}" ]; then
        candidates=($SLURM_LOCAL_NAMES)
    else
        candidates=("$host" localhost $(awk '$1 ~ /^(127\.|::1$)/ {for (i = 2; i <= NF; i++) print $i}' \
                                        /etc/hosts 2>/dev/null))
    fi
    for name in "${candidates[@]}"; do
        [[ $name =~ ^[A-Za-z][A-Za-z0-9-]*$ ]] || continue  # no dots: Slurm host lists split on them poorly
        addr=$(getent hosts "$name" | awk '{print $1; exit}')
        [ -n "$addr" ] && is_local_address "$addr" && echo "$name"
    done | awk '!seen[$0]++' | head -n "$NODES"
}

mapfile -t names < <(node_names)
if [ "${#names[@]}" -lt "$NODES" ]; then
    echo "slurm: $NODES nodes need $NODES host names that resolve to this machine; found ${#names[@]}" \
         "(${names[*]}): list more in SLURM_LOCAL_NAMES" >&2
    exit 1
fi

cluster_up() {  # our controller answers and every node of ours is ready for jobs
    [ -f "$SLURM_CONF" ] || return 1
    scontrol ping 2>/dev/null | grep -q "is UP" || return 1
    local ready
    ready=$(sinfo -h -N -o "%N %T" 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)/ {print $1}' | sort -u)
    [ "$ready" = "$(printf '%s\n' "${names[@]}" | sort -u)" ]
}

if cluster_up; then
    echo "slurm: already up in $DIR (nodes ${names[*]})"
    exit 0
fi
for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "slurm: $tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
# Daemons of this folder left from another layout would keep serving the old nodes: start from scratch.
bash "$(dirname "$0")/down.sh" "$DIR" >/dev/null

mkdir -p "$DIR"/{munge,state,run,log}
# munge authenticates every Slurm message; this cluster has its own key and socket. As root, --force lets
# munged start despite its checks on the ownership of these paths.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$DIR/munge/munge.key"
munged --force --socket "$DIR/munge/munged.sock" --key-file "$DIR/munge/munge.key" \
       --pid-file "$DIR/munge/munged.pid" --log-file "$DIR/munge/munged.log" --seed-file "$DIR/munge/munged.seed"

: > "$DIR/plugstack.conf"  # no SPANK plugins of the machine's own Slurm
hardware=$(slurmd -C | head -n1 | sed 's/^NodeName=[^ ]* //')
{
    cat <<CONF
# Written by slurm/local/up.sh: a test cluster on one machine, all of it in $DIR.
ClusterName=merger-local
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munged.sock
PlugStackConfig=$DIR/plugstack.conf
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
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    # Each slurmd listens on its own port; all traffic stays on the loopback interface.
    for i in "${!names[@]}"; do
        echo "NodeName=${names[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1 + i)) $hardware State=UNKNOWN"
    done
} > "$SLURM_CONF"

# -f on every daemon's command line: down.sh recognises this folder's daemons by it.
slurmctld -f "$SLURM_CONF"
for name in "${names[@]}"; do
    mkdir -p "$DIR/spool/$name"
    slurmd -f "$SLURM_CONF" -N "$name"
done

# A node left DOWN by an earlier run does not come back by itself: resume it.
for _ in $(seq 60); do
    cluster_up && { echo "slurm: up in $DIR (nodes ${names[*]}, partition debug; export SLURM_CONF=$SLURM_CONF)"; exit 0; }
    for name in $(sinfo -h -N -t down,drain -o %N 2>/dev/null); do
        scontrol update nodename="$name" state=resume 2>/dev/null || true
    done
    sleep 0.5
done
echo "slurm: the nodes did not become idle; see $DIR/log/slurmctld.log and $DIR/log/slurmd-*.log" >&2
sinfo -N >&2 || true
exit 1
