#!/bin/bash
# guest.sh CMD [ARGS...]: runs CMD in a throw-away qemu guest that has the Soft-RoCE device
# rxe0 on its loopback, in the current directory, with the caller's environment; streams
# its output and exits with its status (124: timeout, 125: the guest did not come up).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib.sh"
[ $# -gt 0 ] || { echo "usage: $0 CMD [ARGS...]   (see $here/README.md)" >&2; exit 2; }

# One guest holds both ends of every test: a 256 MiB echo alone has two processes that
# each hold the message twice beside their pools, which left 2G a few hundred MB from the
# OOM killer.
default_mem=3G
start_run
write_cmd guest "$@"
cpus=${SOFTROCE_CPUS:-$(( $(nproc) < 2 ? $(nproc) : 2 ))}
boot guest "$cpus"
qemu=$!
trap 'kill $qemu 2>/dev/null; exit 130' INT TERM
relay "$ctl/guest.out" $qemu &
relay "$ctl/guest.err" $qemu >&2 &
wait $qemu
status=$?
wait

if [ -s "$ctl/guest.rc" ]; then
    exit "$(cat "$ctl/guest.rc")"
elif timed_out $status; then
    echo "softroce: timed out after ${timeout_s}s (SOFTROCE_TIMEOUT)" >&2
    exit 124
fi
echo "softroce: the guest did not come up or died (qemu status $status)" >&2
console_tail guest
exit 125
