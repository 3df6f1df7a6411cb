#!/usr/bin/env bash
# A throwaway SLURM "cluster" on this machine, for tests and for trying hydra/launcher=slurm:
# munged, slurmctld and three slurmd: nodes n1 and n2 in the default partition "debug", and n3
# where the partition "urgent" preempts jobs of "low" (requeued, after the --signal and 60 s of grace).
# Every config, pid, log, socket and state file is under DIR, and no other file is touched. Needs root and Debian's
# packages (apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge).
#
#   scripts/slurm/cluster.sh start DIR     # prints the line to eval: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm/cluster.sh stop DIR      # stops the daemons by their pid files
#
# Each node gets every CPU of this machine (CPUS=N to change it), no GPU, and no cgroups
# (proctrack/linuxproc, task/none) so it runs in containers. No accounting database: rlhf's
# SLURM launcher reads job states from squeue.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$(realpath -m "$2")
nodes=(n1 n2 n3)
daemons=(slurmd-n1 slurmd-n2 slurmd-n3 slurmctld munged)  # stop order

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

stop() {
    for name in "${daemons[@]}"; do
        pidfile=$dir/run/$name.pid
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds
    local seconds=$1 what=$2; shift 2
    for _ in $(seq $((seconds * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "$0: $what did not come up within ${seconds}s; logs in $dir/log" >&2
    tail -n 20 "$dir"/log/*.log >&2 || true
    stop
    exit 1
}

start() {
    [[ $(id -u) -eq 0 ]] || { echo "$0: needs root (slurmd runs jobs as their users)" >&2; exit 1; }
    for tool in munged mungekey slurmctld slurmd sbatch; do
        command -v "$tool" >/dev/null || {
            echo "$0: $tool not found; apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge" >&2
            exit 1
        }
    done
    mkdir -p "$dir"/{run,log,state/ctld,munge} "${nodes[@]/#/$dir/state/}"
    chmod 700 "$dir/munge"
    mungekey --create --keyfile="$dir/munge/munge.key" --force
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    wait_for 10 munged test -S "$dir/munge/munge.socket"

    local host cpus
    host=$(hostname -s)
    cpus=${CPUS:-$(nproc)}
    cat >"$dir/slurm.conf" <<CONF
ClusterName=rlhf-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state/ctld
SlurmdSpoolDir=$dir/state/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
LaunchParameters=use_interactive_step
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
NodeName=n3 NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=low Nodes=n3 MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=n3 MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    wait_for 20 slurmctld scontrol ping
    for node in "${nodes[@]}"; do slurmd -f "$SLURM_CONF" -N "$node"; done
    wait_for 30 "every slurmd" bash -c "[[ \$(sinfo -h -N -t idle -o %N | sort -u | wc -l) -eq ${#nodes[@]} ]]"
    echo "export SLURM_CONF=$SLURM_CONF"
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
