#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
#
# When the arguments select the `rdma` marker (`-m rdma`, `-m "rdma and not slow"`) and this
# machine has no RDMA device, those tests run inside a soft-RoCE guest instead
# (scripts/rdma_vm.sh: Debian's kernel, rdma_rxe, the same checkout and venv), where they
# cannot skip for lack of a device; the guest's exit status is this script's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
scripts/setup_system.sh

selects_rdma() {
    local prev=""
    for a in "$@"; do
        case "$a" in -m*rdma*) [[ "$a" == -m?* ]] && return 0 ;; esac
        [ "$prev" = "-m" ] && [[ "$a" == *rdma* ]] && return 0
        prev=$a
    done
    return 1
}

# test files that mark rdma tests: collecting only those saves minutes under emulation
rdma_files() { grep -rl --include='test_*.py' 'mark\.rdma' tests | sort; }
names_paths() { local a; for a in "$@"; do [ -e "${a%%::*}" ] && return 0; done; return 1; }

if selects_rdma "$@" && ! compgen -G "/sys/class/infiniband/*" >/dev/null && [ "${BLINK_RDMA_VM:-1}" != 0 ]; then
    echo "test.sh: no RDMA device here: running the rdma tests in a soft-RoCE guest (scripts/rdma_vm.sh)" >&2
    paths=()
    names_paths "$@" || mapfile -t paths < <(rdma_files)
    export BLINK_VM_TIMEOUT_S="${BLINK_VM_TIMEOUT_S:-3600}"   # everything runs under emulation
    exec scripts/rdma_vm.sh run -- "$(printf '%q ' env BLINK_REQUIRE_RDMA=1 .venv/bin/python -m pytest -q \
        -p no:cacheprovider -rs "$@" "${paths[@]}")"
fi
exec .venv/bin/python -m pytest -q "$@"
