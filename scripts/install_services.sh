#!/usr/bin/env bash
# Install the BLINK systemd services: blink-gpu-daemon on the GPU host, blink-dpu-frontend on
# the BlueField DPU (docs/deployment.md). Idempotent; never overwrites an existing /etc/blink/*.env.
#
#   scripts/install_services.sh --role gpu|dpu|both [--venv DIR] [--create-venv] [--root DIR]
#                               [--enable] [--start]
#
#   --role         gpu: blink-gpu-daemon; dpu: blink-dpu-frontend; both: one machine runs both
#   --venv DIR     Python environment with blink installed (default /opt/blink/venv)
#   --create-venv  create DIR from this checkout (--system-site-packages, so Debian's
#                  python3-pyverbs is visible) with the extras the role needs
#   --root DIR     install into DIR instead of / (packaging, tests); touches no running system
#   --enable       systemctl enable the unit(s); --start also starts them
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
role="" venv=/opt/blink/venv root=/ create_venv=0 enable=0 start=0

die() { echo "install_services: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --role) role="${2:-}"; shift 2 ;;
        --venv) venv="${2:-}"; shift 2 ;;
        --root) root="${2:-}"; shift 2 ;;
        --create-venv) create_venv=1; shift ;;
        --enable) enable=1; shift ;;
        --start) enable=1; start=1; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
case "$role" in
    gpu) units=(blink-gpu-daemon) ;;
    dpu) units=(blink-dpu-frontend) ;;
    both) units=(blink-gpu-daemon blink-dpu-frontend) ;;
    *) die "--role gpu|dpu|both is required" ;;
esac
case "$venv" in /*) ;; *) die "--venv must be an absolute path" ;; esac
[ -d "$root" ] || die "--root $root is not a directory"
root="$(cd "$root" && pwd)"
live=0
if [ "$root" = / ]; then
    [ "$(id -u)" = 0 ] || die "run as root (or give --root DIR for a staged install)"
    [ -d /run/systemd/system ] && live=1
fi
R() { if [ "$root" = / ]; then echo "$1"; else echo "$root$1"; fi; }

libexec=/usr/local/lib/blink
unitdir=/etc/systemd/system
confdir=/etc/blink
docdir=/usr/local/share/doc/blink

# 1. The Python environment (optional: a wheel install or an existing venv works too).
if [ "$create_venv" = 1 ]; then
    [ "$root" = / ] || die "--create-venv installs into the live system only"
    case "$role" in gpu|both) extras="gpu,cuda,rdma" ;; dpu) extras="rdma" ;; esac
    python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "$repo[$extras]"
fi
if [ "$root" = / ] && [ ! -x "$venv/bin/blink" ]; then
    die "$venv/bin/blink not found: install blink there first (or pass --create-venv)"
fi

# 2. The service user (systemd-sysusers: the same declaration works offline with --root).
install -D -m 0644 "$here/systemd/blink.sysusers" "$(R /usr/lib/sysusers.d/blink.conf)"
if [ "$root" = / ]; then
    systemd-sysusers /usr/lib/sysusers.d/blink.conf
else
    mkdir -p "$root/etc"
    systemd-sysusers --root="$root" blink.conf
fi

# 3. Units (paths filled in), the start check, the docs.
install -d -m 0755 "$(R "$unitdir")" "$(R "$libexec")" "$(R "$docdir")"
install -m 0755 "$here/systemd/blink-wait-ready" "$(R "$libexec/blink-wait-ready")"
install -m 0644 "$repo/docs/deployment.md" "$(R "$docdir/deployment.md")"
for u in "${units[@]}"; do
    sed -e "s|@VENV@|$venv|g" -e "s|@LIBEXEC@|$libexec|g" "$here/systemd/$u.service" > "$(R "$unitdir/$u.service").tmp"
    chmod 0644 "$(R "$unitdir/$u.service").tmp"
    mv "$(R "$unitdir/$u.service").tmp" "$(R "$unitdir/$u.service")"
done

# 4. Settings: created once, then owned by the administrator.
install -d -m 0755 "$(R "$confdir")"
for u in "${units[@]}"; do
    env="${u#blink-}.env"
    dst="$(R "$confdir/$env")"
    if [ -e "$dst" ]; then
        echo "install_services: keeping existing $confdir/$env"
    else
        install -m 0640 "$here/systemd/$env" "$dst"
        if [ "$root" = / ]; then chgrp blink "$dst"; fi
    fi
done

# 5. The running system.
if [ "$live" = 1 ]; then
    systemctl daemon-reload
    if [ "$enable" = 1 ]; then systemctl enable "${units[@]/%/.service}"; fi
    if [ "$start" = 1 ]; then systemctl start "${units[@]/%/.service}"; fi
fi
echo "install_services: installed ${units[*]} into $root (venv $venv)"
for u in "${units[@]}"; do
    echo "  settings: $confdir/${u#blink-}.env   start: systemctl enable --now $u   logs: journalctl -u $u"
done
