#!/usr/bin/env bash
# Throw-away local SLURM cluster for tests. Idempotent. Last stdout line = config dir.
# Env: SLURM_LOCAL_DIR (/tmp/slurm-local/cluster), SLURM_LOCAL_NODES (1; >1 = n1..nN via
# multiple slurmd), SLURM_LOCAL_WITH_MPI (1: also openmpi + pmix), SLURM_LOCAL_PORT (6817),
# SLURM_LOCAL_CPUS (CPUs each node advertises; default nproc, more = oversubscribed emulation).
# bf_interval=1: heterogeneous jobs are started only by the backfill scheduler (30 s default interval).
set -euo pipefail
B=${SLURM_LOCAL_DIR:-/tmp/slurm-local/cluster}; N=${SLURM_LOCAL_NODES:-1}
PORT=${SLURM_LOCAL_PORT:-6817}; H=$(hostname -s); CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
export SLURM_CONF=$B/etc/slurm.conf
log() { echo "[start-local-slurm] $*" >&2; }
t0=$(date +%s%N); el() { echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms"; }
alive() { local p; p=$(cat "$1") && [ -r /proc/$p/stat ] &&
  [ "$(cat /proc/$p/comm)" = "$2" ] && [ "$(awk '{print $3}' /proc/$p/stat)" != Z ]; } 2>/dev/null

pk=(slurmctld slurmd slurm-client munge)
[ "${SLURM_LOCAL_WITH_MPI:-1}" = 1 ] && pk+=(openmpi-bin libopenmpi-dev libpmix-dev)
miss=(); for p in "${pk[@]}"; do
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"ok installed" ]] || miss+=("$p"); done
if [ ${#miss[@]} -gt 0 ]; then
  log "installing ${miss[*]}"
  pol=0; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d; pol=1; }   # postinst must not start system daemons
  rc=0; { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${miss[@]}"; } >&2 || rc=$?
  [ $pol = 0 ] || rm -f /usr/sbin/policy-rc.d; [ $rc = 0 ] || exit 1
  log "installed in $(el)"
fi

if [ "$N" -le 1 ]; then NODES=("$H"); NL="NodeName=$H Port=$((PORT + 1))"
else NODES=(); for i in $(seq "$N"); do NODES+=("n$i"); done
  NL="NodeName=n[1-$N] NodeHostname=$H Port=$((PORT + 1))-$((PORT + N))"; fi
PARAMS="$N $CPUS $PORT $H"
idle() { [ "$(timeout 10 sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "$N" ]; }

ok=1; alive "$B/munge/munged.pid" munged && alive "$B/run/slurmctld.pid" slurmctld || ok=0
for n in "${NODES[@]}"; do alive "$B/run/slurmd-$n.pid" slurmd || ok=0; done
if [ $ok = 1 ] && [ "$(cat "$B/params" 2>/dev/null)" = "$PARAMS" ] && idle; then
  log "already running"; echo "$B/etc"; exit 0; fi
[ ! -d "$B/run" ] || "$(dirname "$(readlink -f "$0")")/stop-local-slurm.sh" >&2

rm -rf "$B"/{etc,state,spool,log,run,tmp} "$B"/munge/munge.socket.2* "$B/munge/munged.pid"
mkdir -p "$B"/{etc,state,log,run,munge}; chmod 755 "$B" "$B/munge"  # munged: socket dir a+x
for n in "${NODES[@]}"; do mkdir -p "$B/spool/$n" "$B/tmp/$n"; done
[ -s "$B/munge/munge.key" ] || dd if=/dev/urandom of="$B/munge/munge.key" bs=1k count=1 status=none
chmod 400 "$B/munge/munge.key"
cat >"$SLURM_CONF" <<EOF
ClusterName=localtest
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
AuthInfo=socket=$B/munge/munge.socket.2
StateSaveLocation=$B/state
SlurmdSpoolDir=$B/spool/%n
TmpFS=$B/tmp/%n
SlurmctldPidFile=$B/run/slurmctld.pid
SlurmdPidFile=$B/run/slurmd-%n.pid
SlurmctldLogFile=$B/log/slurmctld.log
SlurmdLogFile=$B/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
$([ "$CPUS" -le "$(nproc)" ] || echo "SlurmdParameters=config_overrides")
$NL NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
echo "export SLURM_CONF=$SLURM_CONF" >"$B/etc/env.sh"; echo "$PARAMS" >"$B/params"

t0=$(date +%s%N); M=$B/munge
munged -S "$M/munge.socket.2" --key-file="$M/munge.key" --pid-file="$M/munged.pid" \
  --log-file="$M/munged.log" --seed-file="$M/munged.seed" </dev/null >/dev/null 2>&1
slurmctld -c -f "$SLURM_CONF" </dev/null >/dev/null 2>&1   # -c: no old job state
for n in "${NODES[@]}"; do slurmd -N "$n" -f "$SLURM_CONF" </dev/null >/dev/null 2>&1; done
end=$((SECONDS + 60))
until idle; do [ $SECONDS -lt $end ] || { log "not idle; see $B/log"; exit 1; }; sleep 0.2; done
log "idle after $(el)"
# first batch scheduling pass comes ~3 s after start: wait for one trivial job
j=$(sbatch --parsable -J warmup -o /dev/null --wrap true)
while [ -n "$(squeue -h -j "$j" 2>/dev/null)" ]; do
  [ $SECONDS -lt $end ] || { log "warm-up job stuck"; exit 1; }; sleep 0.1; done
[[ $(scontrol show job "$j") == *JobState=COMPLETED* ]] || { log "warm-up job failed"; exit 1; }
# plain sinfo/sbatch without SLURM_CONF find this cluster (only if the path is free)
[ -e /etc/slurm/slurm.conf ] || { mkdir -p /etc/slurm; ln -s "$SLURM_CONF" /etc/slurm/slurm.conf; }
log "ready after $(el); export SLURM_CONF=$SLURM_CONF"
echo "$B/etc"
