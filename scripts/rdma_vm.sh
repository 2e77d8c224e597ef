#!/usr/bin/env bash
# Soft-RoCE guests: run commands on a real kernel verbs driver (rdma_rxe) inside qemu.
#
#   scripts/rdma_vm.sh build              build the guest image once (cached), print its folder
#   scripts/rdma_vm.sh run [opts] -- CMD  boot a guest, run CMD (bash) in the checkout, power off;
#                                         exits with CMD's status (124: timed out, 125: guest failed)
#   scripts/rdma_vm.sh pair [opts]        two guests joined by a virtual link on the host's loopback:
#                                         `blink gpu-daemon --transport verbs` in one, `blink frontend
#                                         --transport verbs` in the other, one OpenAI request across
#
# Image: Debian bookworm (debootstrap --variant=minbase from the mirror apt already uses) with
# Debian's kernel, rdma-core, ibverbs-providers, perftest and python3-pyverbs, as an ext4 file,
# kernel and initrd beside it, under ${BLINK_CACHE_DIR:-~/.cache/blink}/rdma-vm/<recipe hash>/.
# The folder's name hashes the recipe (suite, packages, write_init and build as bash prints
# them), so changing the recipe rebuilds the image; editing how guests boot does not.
#
# A run: qemu-system-x86_64 (TCG: KVM hangs on these machines) boots that kernel straight
# into /sbin/blink-init (no systemd), the root image opened with snapshot=on (the cached image
# never changes). Folders of the host reach the guest over virtio 9p at the same paths, read
# only, each under a tmpfs overlay so the guest may write (pycache, caches) without touching
# the host: the checkout, the venv's base Python (pyenv or /usr), the BLINK cache (models).
# A per-run control folder (9p, read-write) carries the command in and its exit status out.
# blink-init loads rdma_rxe, makes `rxe0` over a dummy netdev with an address (its RoCE v2
# GID), runs the command with its output on the serial console (this script's stdout), writes
# the status and powers off. The host side always kills qemu: on timeout and on any exit.
# Guests get no NIC to the outside (-nic none); `pair` links its two guests with a qemu
# stream netdev on 127.0.0.1 only.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_ROOT="${BLINK_CACHE_DIR:-$HOME/.cache/blink}"
SUITE=bookworm
GUEST_PACKAGES=linux-image-amd64,initramfs-tools,kmod,iproute2,mount,procps,rdma-core,ibverbs-providers,ibverbs-utils,perftest,python3,python3-pyverbs,ca-certificates
GUEST_MEM="${BLINK_VM_MEM:-4096}"     # MiB per guest
GUEST_CPUS="${BLINK_VM_CPUS:-2}"

log() { echo "rdma-vm: $*" >&2; }
die() { log "$*"; exit 125; }

# -- host tools -------------------------------------------------------------------------
ensure_host_tools() {
    local need=()
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
    [ ${#need[@]} -eq 0 ] && return 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
        || die "missing ${need[*]}; install them (as root: apt-get install ${need[*]})"
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
        || die "could not install ${need[*]} (no package mirror reachable?)"
}

debian_mirror() {
    [ -n "${BLINK_DEBIAN_MIRROR:-}" ] && { echo "$BLINK_DEBIAN_MIRROR"; return; }
    local m
    m="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)"
    [ -z "$m" ] && m="$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1)"
    echo "${m:-http://deb.debian.org/debian}"
}

# -- the guest's init (PID 1) ------------------------------------------------------------------
write_init() {
    cat >"$1" <<'INIT'
#!/bin/sh
# PID 1 of a BLINK soft-RoCE guest (written by scripts/rdma_vm.sh): mount, make rxe0, run
# /blink/ctl/cmd.sh, leave its status in /blink/ctl/rc, power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mnt() { mountpoint -q "$3" || mount -t "$1" "$2" "$3"; }   # the initramfs already moved some
mnt proc proc /proc; mnt sysfs sys /sys; mnt devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs -o mode=1777 shm /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run; chmod 1777 /tmp
echo 1 >/proc/sys/kernel/sysrq
off() { sync; echo o >/proc/sysrq-trigger; sleep 30; }
for m in 9pnet_virtio 9p overlay virtio_net dummy ib_uverbs rdma_rxe; do modprobe -q $m || echo "blink-init: modprobe $m failed"; done
mkdir -p /blink/ctl
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 ctl /blink/ctl || { echo "blink-init: no control share"; off; }
. /blink/ctl/guest.env                  # GUEST_NAME, GUEST_IP, LINK_IP, SHARES ("tag:path ..."), WORKDIR
hostname "$GUEST_NAME"; ip link set lo up
mkdir -p /blink/upper; mount -t tmpfs -o size=75% upper /blink/upper
for s in $SHARES; do
    tag=${s%%:*}; path=${s#*:}
    mkdir -p "/blink/lower/$tag" "/blink/upper/$tag/u" "/blink/upper/$tag/w" "$path"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro "$tag" "/blink/lower/$tag" \
        && mount -t overlay overlay -o "lowerdir=/blink/lower/$tag,upperdir=/blink/upper/$tag/u,workdir=/blink/upper/$tag/w" "$path" \
        || echo "blink-init: cannot mount $tag at $path"
done
# soft-RoCE: rxe0 over a dummy netdev (one guest), or over the virtio link to the other guest
if [ -n "${LINK_IP:-}" ]; then
    dev=$(ls /sys/class/net | grep -v -e '^lo$' -e dummy | head -1)
    ip addr add "$LINK_IP" dev "$dev"; ip link set "$dev" up
else
    dev=dummy0; [ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy; ip addr add "$GUEST_IP" dev dummy0; ip link set dummy0 up
fi
rdma link add rxe0 type rxe netdev "$dev" || echo "blink-init: rdma link add failed"
cd "${WORKDIR:-/}"
echo "blink-init: $(uname -r), rxe0 over $dev ($(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)), running the command"
sh -c 'exec bash /blink/ctl/cmd.sh' </dev/null
echo $? >/blink/ctl/rc
off
INIT
    chmod 755 "$1"
}

# -- build -------------------------------------------------------------------------------------
build() {
    if [ -f "$IMAGE_DIR/ok" ]; then echo "$IMAGE_DIR"; return 0; fi
    ensure_host_tools
    [ "$(id -u)" = 0 ] || die "building the guest image needs root (debootstrap)"
    mkdir -p "$CACHE_ROOT/rdma-vm"
    exec 9>"$CACHE_ROOT/rdma-vm/.lock"
    flock 9                                       # one build per machine at a time
    if [ -f "$IMAGE_DIR/ok" ]; then echo "$IMAGE_DIR"; return 0; fi
    local work t0=$SECONDS mirror
    mirror="$(debian_mirror)"
    work="$(mktemp -d "$CACHE_ROOT/rdma-vm/build.XXXXXX")"; CLEANUP_DIRS+=("$work")
    log "building the guest image ($SUITE from $mirror) in $work"
    debootstrap --variant=minbase --include="$GUEST_PACKAGES" "$SUITE" "$work/root" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
    write_init "$work/root/sbin/blink-init"
    rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"*
    mkdir -p "$IMAGE_DIR.tmp"; CLEANUP_DIRS+=("$IMAGE_DIR.tmp")
    cp -L "$work/root/vmlinuz" "$IMAGE_DIR.tmp/vmlinuz"
    cp -L "$work/root/initrd.img" "$IMAGE_DIR.tmp/initrd.img"
    local mb
    mb=$(( $(du -sm "$work/root" | cut -f1) + 256 ))
    mkfs.ext4 -q -F -L blinkroot -d "$work/root" "$IMAGE_DIR.tmp/root.img" "${mb}M"
    echo "$SUITE $mirror $GUEST_PACKAGES" >"$IMAGE_DIR.tmp/recipe"
    rm -rf "$IMAGE_DIR"; mv "$IMAGE_DIR.tmp" "$IMAGE_DIR"; touch "$IMAGE_DIR/ok"
    for old in "$CACHE_ROOT"/rdma-vm/*/; do      # images of older recipes
        [ "${old%/}" != "$IMAGE_DIR" ] && [ -f "$old/ok" ] && rm -rf "$old"
    done
    log "image ready in $((SECONDS - t0)) s: $IMAGE_DIR"
    echo "$IMAGE_DIR"
}

# -- boot ----------------------------------------------------------------------------------------
QEMU_PIDS=()
CLEANUP_DIRS=()
cleanup() {
    local p
    for p in "${QEMU_PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for p in "${QEMU_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    for p in "${CLEANUP_DIRS[@]}"; do rm -rf "$p"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The host folders a guest sees, as "tag:path" (same path inside): the checkout, the venv's
# base Python when it lives outside /usr, the BLINK cache.
shares() {
    local out="repo:$REPO" base
    if [ -x "$REPO/.venv/bin/python" ]; then
        base="$("$REPO/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')"
        case "$base" in /usr|/usr/local) ;; *) out+=" py:$base" ;; esac
    fi
    [ -d "$CACHE_ROOT" ] && out+=" cache:$CACHE_ROOT"
    echo "$out"
}

# boot_guest NAME CTL_DIR GUEST_IP LINK_IP NETDEV_ARGS... : start qemu in the background
boot_guest() {
    local name=$1 ctl=$2 ip=$3 link_ip=$4; shift 4
    local args=() s tag path
    cat >"$ctl/guest.env" <<EOF
GUEST_NAME=$name
GUEST_IP=$ip
LINK_IP=$link_ip
SHARES="$(shares)"
WORKDIR=$REPO
EOF
    args+=(-fsdev "local,id=ctl,path=$ctl,security_model=none" -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl)
    for s in $(shares); do
        tag=${s%%:*}; path=${s#*:}
        args+=(-fsdev "local,id=$tag,path=$path,security_model=none,readonly=on"
               -device "virtio-9p-pci,fsdev=$tag,mount_tag=$tag")
    done
    qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max -smp "$GUEST_CPUS" -m "$GUEST_MEM" \
        -display none -monitor none -serial "file:$ctl/console.log" -no-reboot -nodefaults \
        -kernel "$IMAGE_DIR/vmlinuz" -initrd "$IMAGE_DIR/initrd.img" \
        -append "root=LABEL=blinkroot rw console=ttyS0 quiet loglevel=3 panic=-1 init=/sbin/blink-init" \
        -drive "file=$IMAGE_DIR/root.img,format=raw,if=virtio,snapshot=on" \
        "${args[@]}" "$@" </dev/null >"$ctl/qemu.log" 2>&1 &
    QEMU_PIDS+=($!)
}

# follow FILE while PID lives (the guest console to our stdout)
follow() { tail -n +1 -f --pid="$2" "$1" 2>/dev/null | sed -u "s/\r\$//; ${3:+s/^/[$3] /}"; }

# wait_guests TIMEOUT_S PIDS... : 0 when all exited in time, 124 otherwise (then killed)
wait_guests() {
    local timeout_s=$1; shift
    local deadline=$((SECONDS + timeout_s)) p alive
    while :; do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            for p in "$@"; do kill -9 "$p" 2>/dev/null || true; done
            return 124
        fi
        sleep 1
    done
}

run() {
    local timeout_s="${BLINK_VM_TIMEOUT_S:-1800}"
    while [ $# -gt 0 ]; do
        case "$1" in
            --timeout) timeout_s=$2; shift 2 ;;
            --) shift; break ;;
            *) break ;;
        esac
    done
    [ $# -gt 0 ] || die "usage: scripts/rdma_vm.sh run [--timeout S] -- COMMAND..."
    build >/dev/null
    local ctl t0=$SECONDS rc
    ctl="$(mktemp -d /tmp/blink-rdma-vm.XXXXXX)"; CLEANUP_DIRS+=("$ctl")
    printf '%s\n' "$*" >"$ctl/cmd.sh"
    : >"$ctl/console.log"
    log "booting a guest (TCG, ${GUEST_CPUS} vCPUs, ${GUEST_MEM} MiB) to run: $*"
    boot_guest blink-rxe "$ctl" 10.77.0.1/24 "" -nic none
    local qpid=${QEMU_PIDS[-1]}
    follow "$ctl/console.log" "$qpid" &
    local fpid=$!
    if wait_guests "$timeout_s" "$qpid"; then rc=0; else rc=$?; fi
    wait "$fpid" 2>/dev/null || true
    if [ $rc = 124 ]; then
        log "guest killed after ${timeout_s} s (timeout)"; return 124
    fi
    if [ ! -f "$ctl/rc" ]; then
        cat "$ctl/qemu.log" >&2
        log "the guest stopped without a status after $((SECONDS - t0)) s (boot failure? console above)"
        return 125
    fi
    rc=$(cat "$ctl/rc")
    log "guest done in $((SECONDS - t0)) s, status $rc"
    return "$rc"
}

RECIPE_HASH="$( { echo "$SUITE $GUEST_PACKAGES"; declare -f write_init build; } | sha256sum | cut -c1-16)"
IMAGE_DIR="$CACHE_ROOT/rdma-vm/$RECIPE_HASH"
# What the two guests of `pair` run (MODEL comes first in their cmd.sh).
pair_gpu_cmd() {
    cat <<'EOF'
echo "== gpu guest: $(hostname); $(ip -br addr | grep -v '^lo' | tr -s ' ' | tr '\n' ';')"
rdma link
.venv/bin/blink gpu-daemon --model "$MODEL" --ring blink-pair --transport verbs \
    --rdma-listen 10.78.0.1:7470 --slots 16 >/tmp/daemon.log 2>&1 &
pid=$!
while [ ! -e /blink/ctl/stop ] && kill -0 $pid 2>/dev/null; do sleep 1; done
kill -TERM $pid 2>/dev/null; wait $pid; rc=$?
echo "== daemon log (exit $rc)"; cat /tmp/daemon.log
exit $rc
EOF
}

pair_dpu_cmd() {
    cat <<'EOF'
echo "== dpu guest: $(hostname); $(ip -br addr | grep -v '^lo' | tr -s ' ' | tr '\n' ';')"
.venv/bin/blink frontend --model "$MODEL" --transport verbs --daemon 10.78.0.1:7470 --port 8000 \
    --startup-timeout-s 1200 >/tmp/frontend.log 2>&1 &
pid=$!
.venv/bin/python - <<'PY'
import json, time, urllib.request
import openai
deadline = time.monotonic() + 1200
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5) as r:
            if r.status == 200:
                break
    except Exception:
        pass
    assert time.monotonic() < deadline, "frontend never healthy"
    time.sleep(1)
c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0, timeout=600)
model = c.models.list().data[0].id
question = "What is the capital of France?"
t0 = time.monotonic()
r = c.chat.completions.create(model=model, max_tokens=16, temperature=0,
                              messages=[{"role": "user", "content": question}])
print("== request: chat.completions", json.dumps({"model": model, "max_tokens": 16, "content": question}))
print("== response after %.1f s (under emulation): %s" % (time.monotonic() - t0, r.model_dump_json()))
assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
PY
rc=$?
kill -TERM $pid; wait $pid
echo "== frontend log"; cat /tmp/frontend.log
exit $rc
EOF
}

# Two guests, one link: "gpu" runs the daemon, "dpu" the frontend and one OpenAI request.
pair() {
    local timeout_s="${BLINK_VM_TIMEOUT_S:-1800}" model=null log=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --timeout) timeout_s=$2; shift 2 ;;
            --model) model=$2; shift 2 ;;
            --log) log=$2; shift 2 ;;
            *) die "usage: scripts/rdma_vm.sh pair [--timeout S] [--model null|default] [--log FILE]" ;;
        esac
    done
    build >/dev/null
    local gpu dpu t0=$SECONDS port rc
    gpu="$(mktemp -d /tmp/blink-rdma-gpu.XXXXXX)"; dpu="$(mktemp -d /tmp/blink-rdma-dpu.XXXXXX)"
    CLEANUP_DIRS+=("$gpu" "$dpu")
    port=$(( 20000 + RANDOM % 20000 ))
    { echo "MODEL=$model"; pair_gpu_cmd; } >"$gpu/cmd.sh"
    { echo "MODEL=$model"; pair_dpu_cmd; } >"$dpu/cmd.sh"
    : >"$gpu/console.log"; : >"$dpu/console.log"
    log "two guests joined by a socket netdev on 127.0.0.1:$port: gpu (daemon, --model $model) and dpu (frontend)"
    boot_guest blink-gpu "$gpu" "" 10.78.0.1/24 \
        -netdev "socket,id=link,listen=127.0.0.1:$port" -device virtio-net-pci,netdev=link,mac=52:54:00:78:00:01
    local gpid=${QEMU_PIDS[-1]}
    sleep 1
    boot_guest blink-dpu "$dpu" "" 10.78.0.2/24 \
        -netdev "socket,id=link,connect=127.0.0.1:$port" -device virtio-net-pci,netdev=link,mac=52:54:00:78:00:02
    local dpid=${QEMU_PIDS[-1]}
    follow "$gpu/console.log" "$gpid" gpu &
    follow "$dpu/console.log" "$dpid" dpu &
    if wait_guests "$timeout_s" "$dpid"; then rc=0; else rc=$?; fi
    touch "$gpu/stop"                            # the daemon guest stops once the frontend is done
    wait_guests 180 "$gpid" || true
    wait
    local drc grc
    drc=$(cat "$dpu/rc" 2>/dev/null || echo none); grc=$(cat "$gpu/rc" 2>/dev/null || echo none)
    log "pair done in $((SECONDS - t0)) s: dpu status $drc, gpu status $grc"
    if [ -n "$log" ]; then
        { echo "# scripts/rdma_vm.sh pair --model $model ($(date -u +%FT%TZ), host $(hostname), $(nproc) cores, qemu TCG)"
          echo "## gpu guest console"; sed 's/\r$//' "$gpu/console.log"
          echo "## dpu guest console"; sed 's/\r$//' "$dpu/console.log"
          echo "## result: dpu status $drc, gpu status $grc, $((SECONDS - t0)) s wall"; } >"$log"
    fi
    [ "$rc" = 124 ] && return 124
    [ "$drc" = 0 ] && [ "$grc" = 0 ] || return 1
}

case "${1:-}" in
    build) shift; build ;;
    run) shift; run "$@" ;;
    pair) shift; pair "$@" ;;
    *) echo "usage: scripts/rdma_vm.sh build | run [--timeout S] -- COMMAND... | pair [--model M] [--log F]" >&2
       exit 2 ;;
esac
