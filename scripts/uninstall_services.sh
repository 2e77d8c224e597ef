#!/usr/bin/env bash
# Remove what scripts/install_services.sh installed: stop and disable the BLINK units, remove the
# unit files, the start check and the docs. Settings (/etc/blink), state (/var/lib/blink), the
# model cache (/var/cache/blink) and the blink user stay unless --purge is given.
#
#   scripts/uninstall_services.sh [--root DIR] [--purge]
set -euo pipefail

root=/ purge=0
die() { echo "uninstall_services: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="${2:-}"; shift 2 ;;
        --purge) purge=1; shift ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -d "$root" ] || die "--root $root is not a directory"
root="$(cd "$root" && pwd)"
live=0
if [ "$root" = / ]; then
    [ "$(id -u)" = 0 ] || die "run as root (or give --root DIR)"
    [ -d /run/systemd/system ] && live=1
fi
R() { if [ "$root" = / ]; then echo "$1"; else echo "$root$1"; fi; }

units=(blink-dpu-frontend blink-gpu-daemon)   # frontend first: it depends on the daemon
for u in "${units[@]}"; do
    f="$(R "/etc/systemd/system/$u.service")"
    [ -e "$f" ] || continue
    if [ "$live" = 1 ]; then
        systemctl disable --now "$u.service" || true
    fi
    rm -f "$f"
    echo "uninstall_services: removed $u"
done
rm -f "$(R /usr/local/lib/blink/blink-wait-ready)" "$(R /usr/local/share/doc/blink/deployment.md)"
rmdir "$(R /usr/local/lib/blink)" "$(R /usr/local/share/doc/blink)" 2>/dev/null || true
[ "$live" = 1 ] && systemctl daemon-reload

if [ "$purge" = 1 ]; then
    rm -rf "$(R /etc/blink)" "$(R /var/lib/blink)" "$(R /var/cache/blink)"
    rm -f "$(R /usr/lib/sysusers.d/blink.conf)"
    if [ "$root" = / ]; then
        if id blink >/dev/null 2>&1; then userdel blink; fi
    elif [ -f "$root/etc/passwd" ] && grep -q '^blink:' "$root/etc/passwd"; then
        userdel --root "$root" blink
    fi
    echo "uninstall_services: purged settings, state, cache and the blink user"
else
    echo "uninstall_services: kept /etc/blink, /var/lib/blink, /var/cache/blink and the blink user (--purge removes them)"
fi
