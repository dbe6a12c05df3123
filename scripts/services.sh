#!/usr/bin/env bash
# Single-node Slurm (munge + slurmctld + slurmd) and PostgreSQL 15 for sweeps and their tests.
#
#   scripts/services.sh install   apt-get the Debian 12 packages that are missing (root)
#   scripts/services.sh start     start munged, slurmctld, slurmd and PostgreSQL (no systemd needed)
#   scripts/services.sh stop      stop what `start` started (PIDs and a marker under /run/spectune-services)
#   scripts/services.sh status    one line per service
#   scripts/services.sh ensure    install + start; a no-op when everything is already up
#
# Run as root on a systemd-less Debian 12 box (CI containers, this dev VM). What it sets up:
#   * Slurm 22.05 from Debian packages, one node named `hostname -s` with `nproc` CPUs and
#     MemTotal minus headroom as RealMemory, partition `debug`, no accounting (sacct is off),
#     DefMemPerCPU set so array tasks run side by side (without it CR_Core_Memory hands each job the
#     whole node's memory and an array runs one task at a time). GPUs found as /dev/nvidia0.. are
#     declared as gres gpu:N (untested: the dev VM has none).
#   * PostgreSQL 15 cluster `15/main` on 127.0.0.1:5432 with role+database spectune/spectune,
#     password `spectune` (Optuna storage: postgresql+psycopg://spectune:spectune@127.0.0.1:5432/spectune).
# Settings (environment): SLURM_DEF_MEM_PER_CPU (MB, default 1000), SLURM_MEM_HEADROOM_MB (default 2048),
# PG_VERSION (15), PG_CLUSTER (main). Every step prints one line with its duration.
set -euo pipefail

DEF_MEM_PER_CPU=${SLURM_DEF_MEM_PER_CPU:-1000}
MEM_HEADROOM_MB=${SLURM_MEM_HEADROOM_MB:-2048}
PG_VERSION=${PG_VERSION:-15}
PG_CLUSTER=${PG_CLUSTER:-main}
STATE=/run/spectune-services          # PID files of the daemons this script started
SPOOL=/var/spool/spectune-slurm       # own spool: old state from another ClusterName is fatal
LOG=/var/log/slurm
CONF=/etc/slurm/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge postgresql)

step() {  # step NAME COMMAND...: run it and print "services: NAME ok (1.2 s)"
  local name=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  if "$@"; then
    t1=$(date +%s.%N)
    printf 'services: %-22s ok (%.1f s)\n' "$name" "$(awk "BEGIN{print $t1 - $t0}")"
  else
    local rc=$?
    printf 'services: %-22s FAILED (exit %d)\n' "$name" "$rc" >&2
    return "$rc"
  fi
}

need_root() {
  [ "$(id -u)" = 0 ] || { echo "services: must run as root (uid $(id -u))" >&2; exit 1; }
}

# ---------------------------------------------------------------- install
missing_packages() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

do_install() {
  local missing
  missing=$(missing_packages | tr '\n' ' ')
  [ -z "${missing// /}" ] && return 0
  export DEBIAN_FRONTEND=noninteractive
  # The package postinsts try to start daemons; without systemd that fails harmlessly.
  apt-get update -qq >/dev/null
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

# ---------------------------------------------------------------- helpers
pid_alive() {  # pid_alive NAME: the PID recorded for NAME is a running process
  [ -s "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null
}

munge_up() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
# A slurm.conf written by someone else (a real cluster's node) is never touched: then Slurm is
# "up" when sinfo answers, and `start` only checks that.
own_conf() { [ ! -e "$CONF" ] || head -1 "$CONF" | grep -q '^# Written by spectune'; }
sinfo_idle() { sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated|completing)'; }
# pgrep first: sinfo without a controller retries for ~9 s before it fails.
slurm_up() {
  if own_conf; then pgrep -x slurmctld >/dev/null && pgrep -x slurmd >/dev/null && sinfo_idle
  else sinfo_idle; fi
}
pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
db_up() { PGPASSWORD=spectune psql -h 127.0.0.1 -U spectune -d spectune -tAqc 'SELECT 1' >/dev/null 2>&1; }
all_up() { munge_up && slurm_up && db_up; }

wait_for() {  # wait_for SECONDS COMMAND...: poll every 0.2 s
  local deadline=$(( $(date +%s) + $1 ))
  shift
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

# ---------------------------------------------------------------- munge
start_munge() {
  munge_up && return 0
  mkdir -p /run/munge /var/log/munge /var/lib/munge "$STATE"
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key --force >/dev/null 2>&1 \
      || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munge_up
  cp /run/munge/munged.pid "$STATE/munged.pid" 2>/dev/null || pgrep -x munged | head -1 > "$STATE/munged.pid"
}

# ---------------------------------------------------------------- slurm
write_slurm_conf() {
  local node cpus mem
  node=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/^MemTotal/{print int($2/1024)}' /proc/meminfo) - MEM_HEADROOM_MB ))
  [ "$mem" -ge 1024 ] || mem=1024
  mkdir -p /etc/slurm "$SPOOL/ctld" "$SPOOL/d" "$LOG"
  # GPUs (untested here: no GPU on the dev VM): /dev/nvidia0.. become gres gpu:N for --gres=gpu:K.
  local gpus gres_types="" node_gres=""
  gpus=$(find /dev -maxdepth 1 -name 'nvidia[0-9]*' 2>/dev/null | wc -l)
  if [ "$gpus" -gt 0 ]; then
    gres_types="GresTypes=gpu"
    node_gres=" Gres=gpu:${gpus}"
    echo "NodeName=${node} Name=gpu File=/dev/nvidia[0-$((gpus - 1))]" > /etc/slurm/gres.conf
  fi
  cat > "$CONF.new" <<CONF
# Written by spectune scripts/services.sh: single-node Slurm for sweeps and tests.
ClusterName=spectune
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without DefMemPerCPU a job without --mem gets the whole node's memory: array tasks serialize.
DefMemPerCPU=${DEF_MEM_PER_CPU}
MinJobAge=300
StateSaveLocation=${SPOOL}/ctld
SlurmdSpoolDir=${SPOOL}/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd.log
${gres_types}
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem}${node_gres} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
CONF
  mv "$CONF.new" "$CONF"
}

start_slurm() {
  slurm_up && return 0
  if ! own_conf; then
    echo "services: $CONF belongs to another Slurm setup and sinfo shows no usable node;" \
      "not touching it" >&2
    return 1
  fi
  write_slurm_conf
  if ! pid_alive slurmctld; then
    rm -f /run/slurmctld.pid
    slurmctld -i
    wait_for 10 test -s /run/slurmctld.pid
    cp /run/slurmctld.pid "$STATE/slurmctld.pid"
  fi
  if ! pid_alive slurmd; then
    rm -f /run/slurmd.pid
    slurmd
    wait_for 10 test -s /run/slurmd.pid
    cp /run/slurmd.pid "$STATE/slurmd.pid"
  fi
  # A node left DOWN by an earlier run comes back with ReturnToService=2; nudge it anyway.
  wait_for 30 slurm_up || { scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true; wait_for 15 slurm_up; }
}

# ---------------------------------------------------------------- postgresql
start_postgres() {
  if ! pg_up; then
    [ -d "/etc/postgresql/$PG_VERSION/$PG_CLUSTER" ] || pg_createcluster "$PG_VERSION" "$PG_CLUSTER" >/dev/null
    pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" start
    mkdir -p "$STATE" && touch "$STATE/postgresql.started"   # so `stop` stops only what we started
    wait_for 30 pg_up
  fi
  # Role + database (idempotent). md5/scram over TCP on 127.0.0.1 is Debian's default pg_hba.
  runuser -u postgres -- psql -q -v ON_ERROR_STOP=1 -d postgres <<'SQL' >/dev/null
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'spectune') THEN
    CREATE ROLE spectune LOGIN PASSWORD 'spectune' CREATEDB;
  END IF;
END $$;
SQL
  if ! runuser -u postgres -- psql -tAq -d postgres -c "SELECT 1 FROM pg_database WHERE datname='spectune'" | grep -q 1; then
    runuser -u postgres -- createdb -O spectune spectune
  fi
}

# ---------------------------------------------------------------- stop / status
stop_all() {  # only what `start` started (recorded under $STATE), never a site's own daemons
  local d p
  for d in slurmd slurmctld; do
    [ -s "$STATE/$d.pid" ] || continue
    p=$(cat "$STATE/$d.pid")
    kill "$p" 2>/dev/null || true
    wait_for 15 bash -c "! kill -0 $p 2>/dev/null" || true
    rm -f "$STATE/$d.pid"
  done
  if [ -s "$STATE/munged.pid" ]; then
    p=$(cat "$STATE/munged.pid")
    kill "$p" 2>/dev/null || true
    rm -f "$STATE/munged.pid"
  fi
  if [ -e "$STATE/postgresql.started" ]; then
    pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" stop 2>/dev/null || true
    rm -f "$STATE/postgresql.started"
  fi
}

status() {
  local ok=0
  if munge_up; then echo "munge:      up"; else echo "munge:      down"; ok=1; fi
  if slurm_up; then echo "slurm:      up ($(sinfo -h -o '%P %T %D %c cpus %m MB' | head -1))"; else echo "slurm:      down"; ok=1; fi
  if pg_up; then echo "postgresql: up (127.0.0.1:5432)"; else echo "postgresql: down"; ok=1; fi
  return $ok
}

case "${1:-}" in
  install) need_root; step install do_install ;;
  start)
    need_root
    step munge start_munge
    step slurm start_slurm
    step postgresql start_postgres
    ;;
  stop) need_root; step stop stop_all ;;
  status) status ;;
  ensure)
    if command -v sinfo >/dev/null && all_up; then
      echo "services: all up (no-op)"
      exit 0
    fi
    need_root
    step install do_install
    step munge start_munge
    step slurm start_slurm
    step postgresql start_postgres
    ;;
  *) echo "usage: $0 install|start|stop|status|ensure" >&2; exit 2 ;;
esac
