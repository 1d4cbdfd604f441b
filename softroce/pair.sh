#!/bin/bash
# pair.sh [--b-ready FILE] -- CMD_B [ARGS...] -- CMD_A [ARGS...]
# Two throw-away guests, i.e. two hosts with their own kernels, joined by one Ethernet link
# with rxe0 on each end: B (rxe-b, 192.0.2.2) runs CMD_B; A (rxe-a, 192.0.2.1) runs CMD_A
# once B is ready. Output and exit status are CMD_A's, CMD_B's output goes to stderr as
# "b | " lines. See README.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib.sh"

usage() {
    echo "usage: $0 [--b-ready FILE] -- CMD_B [ARGS...] -- CMD_A [ARGS...]   (see $here/README.md)" >&2
    exit 2
}
ready_file=
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case $1 in
        --b-ready) [ $# -ge 2 ] || usage; ready_file=$2; shift 2 ;;
        *) usage ;;
    esac
done
[ $# -gt 0 ] || usage
shift
cmd_b=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do cmd_b+=("$1"); shift; done
[ $# -gt 0 ] || usage
shift
[ ${#cmd_b[@]} -gt 0 ] && [ $# -gt 0 ] || usage

default_mem=2G
start_run
write_cmd a "$@"
write_cmd b "${cmd_b[@]}"
printf 'ready_file=%q\n' "$ready_file" >> "$ctl/b.cmd"
# A file left by an earlier run would release A before CMD_B is up.
[ -z "$ready_file" ] || rm -f -- "$ready_file"
cpus=${SOFTROCE_CPUS:-1}
never_ready() { echo "softroce: B never became ready${ready_file:+ ($ready_file never appeared)}" >&2; }

# The link is a unix socket in $ctl: B's qemu listens, A's connects. Nothing reaches the
# host's network. (qemu's TCP socket links leave Nagle on: RDMA latency goes to ~20 ms.)
link=$ctl/link
nic() { echo "stream,id=n0,server=$1,addr.type=unix,addr.path=$link"; }
boot b "$cpus" -netdev "$(nic on)" -device virtio-net-pci,netdev=n0,mac=52:54:00:00:00:0b,romfile=
qb=$!
trap 'kill $qb ${qa:-} 2>/dev/null; exit 130' INT TERM
listening() { ss -Hxl src "$link" | grep -q .; }
for i in {1..200}; do
    listening && break
    kill -0 $qb 2>/dev/null || break
    sleep 0.05
done
listening || { kill $qb 2>/dev/null; echo "softroce: guest B's qemu did not open the link" >&2; console_tail b; exit 125; }
boot a "$cpus" -netdev "$(nic off)" -device virtio-net-pci,netdev=n0,mac=52:54:00:00:00:0a,romfile=
qa=$!
relay "$ctl/a.out" $qa &
relay "$ctl/a.err" $qa >&2 &
relay "$ctl/b.out" $qb | sed -u 's/^/b | /' >&2 &

wait -n -p first $qa $qb
status=$?
status_b=
if [ "$first" = $qb ]; then
    status_b=$status
    if [ ! -e "$ctl/b.ready" ]; then
        # A would wait for B for ever.
        kill $qa 2>/dev/null
        wait
        if timed_out $status_b; then
            echo "softroce: timed out after ${timeout_s}s (SOFTROCE_TIMEOUT)" >&2
            never_ready
            exit 124
        fi
        echo "softroce: guest B went down before it was ready (qemu status $status_b)" >&2
        console_tail b
        exit 125
    fi
    wait $qa
    status=$?
fi

# B stops CMD_B (SIGTERM, SIGKILL 5 s later) and powers off.
: > "$ctl/stop"
if [ -z "$status_b" ]; then
    for i in {1..300}; do kill -0 $qb 2>/dev/null || break; sleep 0.1; done
    kill $qb 2>/dev/null
    wait $qb
fi
wait

if [ -e "$ctl/b.stopped" ]; then
    echo "softroce: CMD_B was still running when CMD_A ended: stopped" >&2
elif [ -s "$ctl/b.rc" ]; then
    echo "softroce: CMD_B exited with status $(cat "$ctl/b.rc")" >&2
else
    echo "softroce: guest B went down before CMD_B ended" >&2
fi
if [ -s "$ctl/a.rc" ]; then
    exit "$(cat "$ctl/a.rc")"
elif timed_out $status; then
    echo "softroce: timed out after ${timeout_s}s (SOFTROCE_TIMEOUT)" >&2
    [ -e "$ctl/b.ready" ] || never_ready
    exit 124
fi
echo "softroce: guest A did not come up or died (qemu status $status)" >&2
console_tail a
exit 125
