# PID 1 of a guest (bash, started by guest-init.sh), in the role SOFTROCE_ROLE: "guest"
# (guest.sh), or "a" / "b" (pair.sh). Sets up rxe0, runs the role's command and powers off.
# Files in $ctl: ROLE.cmd (in); ROLE.out, .err, .rc (out); ROLE.failed (setup failed);
# b.ready, set by B, lets A start; stop, set by the host once A has ended, stops B.
# It avoids external programs where it can: each one is loaded over 9p, under emulation.
exec </dev/null
ctl=/run/softroce
role=$SOFTROCE_ROLE
PATH=/usr/sbin:/usr/bin:/sbin:/bin
exec 9<>/run/softroce-nap
nap() { read -r -t "$1" -u 9; }
off() {
    echo o > /proc/sysrq-trigger
    while :; do nap 60; done
}
fail() {
    echo "softroce guest $role: setup failed: $*" > /dev/console
    : > "$ctl/$role.failed"
    off
}

ulimit -l unlimited
ulimit -n 65536
. "$ctl/$role.cmd"
read -r boot_id < /proc/sys/kernel/random/boot_id

if [ "$role" = guest ]; then
    dev=lo self=127.0.0.1
    echo softroce > /proc/sys/kernel/hostname
    echo "127.0.1.1 softroce" >> /etc/hosts
else
    dev=eth0
    if [ "$role" = a ]; then self=192.0.2.1 peer=192.0.2.2 peer_role=b
    else self=192.0.2.2 peer=192.0.2.1 peer_role=a; fi
    # Another host: own name and machine id (the overlay's copies; the boot id differs anyway).
    echo "rxe-$role" > /proc/sys/kernel/hostname
    echo "${boot_id//-/}" > /etc/machine-id
    printf '%s %s\n' "$self" "rxe-$role" "$peer" "rxe-$peer_role" >> /etc/hosts
    [ -e /sys/class/net/eth0 ] || fail "no eth0"
    # MTU 9000: rxe's active MTU becomes 4096 (1024 at 1500).
    ip -b - <<EOF || fail "cannot configure eth0"
link set eth0 mtu 9000
addr add $self/24 dev eth0
link set eth0 up
EOF
fi

rdma link add rxe0 type rxe netdev $dev || fail "rdma link add rxe0 netdev $dev"
# The GID table fills in asynchronously. Look for the RoCEv2 GID of our IPv4 address.
IFS=. read -r o1 o2 o3 o4 <<< "$self"
printf -v want '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$o1" "$o2" "$o3" "$o4"
port=/sys/class/infiniband/rxe0/ports/1
gid_index=
for try in {1..200}; do
    for i in {0..15}; do
        read -r gid 2>/dev/null < $port/gids/$i && [ "$gid" = "$want" ] || continue
        read -r type 2>/dev/null < $port/gid_attrs/types/$i
        [ "$type" = "RoCE v2" ] && { gid_index=$i; break 2; }
    done
    nap 0.05
done
[ -n "$gid_index" ] && [ -e /dev/infiniband/uverbs0 ] || fail "rxe0 has no RoCEv2 GID for $self"
echo "softroce guest $role: rxe0 on $dev, GID index $gid_index, boot id $boot_id" > /dev/console

# The caller's environment, and nothing of the kernel's (TERM=linux...).
unset $(compgen -e)
. "$ctl/env.sh"
if [ "$role" != guest ]; then
    export RXE_ROLE=$role RXE_SELF_ADDR=$self RXE_PEER_ADDR=$peer RXE_NETDEV=$dev \
        RXE_SELF_NAME=rxe-$role RXE_PEER_NAME=rxe-$peer_role RXE_GID_INDEX=$gid_index
fi
cd "$cwd" || fail "cannot cd to $cwd"

if [ "$role" != b ]; then
    if [ "$role" = a ]; then
        until [ -e "$ctl/b.ready" ]; do nap 0.1; done
        # Resolve B's MAC before CMD_A runs, which also proves the link: a datagram to B's
        # discard port makes the kernel ask; an answered entry has flags 0x2.
        linked=
        for try in {1..150}; do
            (( try % 10 == 1 )) && { echo > /dev/udp/$peer/9; } 2>/dev/null
            while read -r ip hw flags rest; do
                [ "$ip" = "$peer" ] && [ "$flags" = 0x2 ] && linked=1
            done < /proc/net/arp
            [ -n "$linked" ] && break
            nap 0.1
        done
        [ -n "$linked" ] || fail "no answer from $peer over eth0"
    fi
    "${cmd[@]}" 9<&- > "$ctl/$role.out" 2> "$ctl/$role.err"
    echo $? > "$ctl/$role.rc"
    off
fi

# Role b: CMD_B runs in its own process group, so that stopping it reaches its children.
running() {
    local stat
    read -r stat < /proc/$1/stat 2>/dev/null || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}
set -m
"${cmd[@]}" 9<&- > "$ctl/b.out" 2>&1 &
pid=$!
set +m
rc=
# Ready once CMD_B has started or, with a ready file, once that exists. A CMD_B that fails
# before then releases A all the same (A's command reports the rest); one that exits 0 may
# have left a daemon behind to create the file.
if [ -n "$ready_file" ]; then
    until [ -e "$ready_file" ]; do
        if [ -z "$rc" ] && ! running $pid; then
            wait $pid
            rc=$?
            [ $rc = 0 ] || break
        fi
        nap 0.05
    done
fi
: > "$ctl/b.ready"
until [ -e "$ctl/stop" ]; do nap 0.2; done
if [ -z "$rc" ] && running $pid; then
    kill -TERM -- -$pid 2>/dev/null
    for i in {1..50}; do running $pid || break; nap 0.1; done
    kill -KILL -- -$pid 2>/dev/null
    : > "$ctl/b.stopped"
fi
[ -n "$rc" ] || { wait $pid; rc=$?; }
echo $rc > "$ctl/b.rc"
off
