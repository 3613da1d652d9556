#!/usr/bin/env bash
# Installs, with apt-get, the Debian packages of the system programs the test suite starts and
# of the libraries the package's native QUIC backend builds against (listed with the tests that
# need them in .ci/system-packages.txt, beside this script) that are missing here. It runs before
# the pip install of the test command, so that the install builds the native extension. Silent when there is nothing to do or all went well; on failure, says what and
# why on stderr and exits non-zero. Needs root, or sudo when not root. The README's test command
# (and so .ci/run) runs it first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
list="$here/system-packages.txt"

missing=()
while read -r program package _tests; do
    case "$program" in ''|'#'*) continue ;; esac
    [ -e "$program" ] || missing+=("$package")
done <"$list"
[ "${#missing[@]}" -eq 0 ] && exit 0

fail() {
    echo "$0: cannot install ${missing[*]} (for the tests, see $list): $*" >&2
    exit 1
}
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
else
    fail "not root and no sudo; as root: apt-get install ${missing[*]}"
fi
command -v apt-get >/dev/null 2>&1 || fail "no apt-get here (a Debian or Ubuntu system is assumed)"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
run() {
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive "$@" >"$log" 2>&1 ||
        fail "'$*' exited $?:"$'\n'"$(tail -n 20 "$log")"
}
run apt-get update -qq
run apt-get install -y -qq "${missing[@]}"

# Debian's redis-server package starts a system instance on port 6379; the tests start their
# own servers on free ports, so stop it (systemd, else the init script). Only the service's
# own instance: other redis-server processes on the machine are left alone.
if [[ " ${missing[*]} " == *" redis-server "* ]]; then
    { "${as_root[@]}" systemctl stop redis-server || "${as_root[@]}" service redis-server stop; } \
        >/dev/null 2>&1 || true
fi
