#!/bin/sh
# /init of the guest's initramfs (busybox). Builds the guest's root: the host's root over
# 9p, read-only, under a tmpfs overlay that takes the guest's writes; the run's control
# directory at /run/softroce and the caller's directory (read-write) on top. Then hands
# over to guest-run.sh. Done here because each program started from the 9p root costs
# ~0.1 s under emulation, busybox applets nothing.
export PATH=/bin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

die() { echo "softroce init: $*" > /dev/console; poweroff -f; }

while read -r m; do insmod "/mods/$m" || die "insmod $m"; done < /mods/order

p9=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o "$p9,ro,cache=loose" host /lower || die "cannot mount the host root"
mount -t tmpfs -o mode=755 tmpfs /rw && mkdir /rw/upper /rw/work || die "tmpfs"
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /root ||
    die "overlay"
r=/root
mkdir -p $r/run/softroce
mount -t 9p -o "$p9" ctl $r/run/softroce || die "cannot mount the control directory"
read -r cwd < $r/run/softroce/cwd
mkdir -p "$r$cwd"
mount -t 9p -o "$p9" cwd "$r$cwd" || die "cannot mount $cwd"

# The kernel's modules are in the kit's cache, wherever the host keeps its own.
read -r moddir < /moddir
mkdir -p "$r/lib/modules/$(uname -r)"
mount --bind "$r$moddir" "$r/lib/modules/$(uname -r)" || die "no modules in $moddir"

for d in proc sys dev; do mount --move /$d $r/$d; done
mkdir -p $r/dev/pts $r/dev/shm
mount -t devpts -o ptmxmode=666 devpts $r/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $r/dev/shm
ln -s /proc/self/fd $r/dev/fd
ln -s /proc/self/fd/0 $r/dev/stdin
ln -s /proc/self/fd/1 $r/dev/stdout
ln -s /proc/self/fd/2 $r/dev/stderr
# bash has no sleep builtin; a read with timeout on a FIFO nobody writes is one.
mkfifo $r/run/softroce-nap
ip link set lo up

# switch_root, not chroot: the kernel's helpers (modprobe on demand) must see the new root.
exec switch_root $r /bin/bash /run/softroce/guest-run.sh
