#!/bin/bash
# Installs what the Soft-RoCE guests need (Debian, as root) and builds their boot files:
# $SOFTROCE_CACHE/vmlinux and initramfs.cpio, from Debian's kernel package. Safe to rerun:
# it only does what is missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib.sh"
export DEBIAN_FRONTEND=noninteractive

# The guests run on the host's own root file system, so the RDMA user space (and anything
# the tests call, like capsh) is installed here, on the host.
packages=(qemu-system-x86 busybox-static kmod xz-utils iproute2 libcap2-bin
          rdma-core ibverbs-providers ibverbs-utils libibverbs-dev librdmacm-dev
          rdmacm-utils perftest python3-pyverbs)
missing=()
for p in "${packages[@]}"; do
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
done
as_root() { [ "$(id -u)" = 0 ] || { echo "softroce: prepare.sh must run as root to $*" >&2; exit 1; }; }
if [ ${#missing[@]} -gt 0 ]; then
    as_root "install ${missing[*]}"
    echo "softroce: installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

artifacts_ok && exit 0

# Kernel modules the initramfs loads itself (with their dependencies): what it takes to
# mount the host root, the pair's NIC, and rdma_rxe, whose load from the 9p root would
# cost seconds per boot under emulation. crc32_generic is what rxe asks the crypto API for.
modules=(virtio_pci 9pnet_virtio 9p overlay virtio_net crc32_generic rdma_rxe ib_uverbs)

as_root "build the guest boot files in $cache"
mkdir -p "$cache"
# One build at a time; a run that waited finds the work done.
exec 8> "$cache/.lock"
flock 8
artifacts_ok && exit 0
echo "softroce: building the guest boot files in $cache"
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The kernel is unpacked into the cache, not installed: the host's own boot setup stays
# as it is, and the guest sees these modules at /lib/modules/<version> (guest-init.sh).
mkdir "$tmp/dl"
chmod 755 "$tmp"
chown _apt "$tmp/dl" 2>/dev/null || true   # else apt warns that it downloads as root
download_kernel() {
    local pkg
    pkg=$(apt-cache depends --important linux-image-amd64 2>/dev/null |
          awk '$2 ~ /^linux-image-[0-9]/ {print $2; exit}')
    [ -n "$pkg" ] && (cd "$tmp/dl" && apt-get download -qq "$pkg")
}
# Package lists that are missing or out of date fail the first try.
download_kernel || { apt-get update -qq && download_kernel; } ||
    { echo "softroce: cannot download Debian's linux-image-amd64 kernel" >&2; exit 1; }
dpkg-deb -x "$tmp"/dl/*.deb "$tmp/kernel"
kver=$(ls "$tmp/kernel/lib/modules")
depmod -b "$tmp/kernel" "$kver"

# Booting the ELF kernel directly skips the guest's own decompression, seconds under TCG.
vmlinuz="$tmp/kernel/boot/vmlinuz-$kver"
offset=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -n1 | cut -d: -f1)
[ -n "$offset" ] || { echo "softroce: $vmlinuz is not xz-compressed" >&2; exit 1; }
tail -c +$((offset + 1)) "$vmlinuz" > "$tmp/vmlinux.xz"
xz -dc --single-stream < "$tmp/vmlinux.xz" > "$tmp/vmlinux"
[ "$(head -c4 "$tmp/vmlinux" | od -An -c | tr -d ' ')" = 177ELF ] ||
    { echo "softroce: could not extract vmlinux from $vmlinuz" >&2; exit 1; }

ird="$tmp/initramfs"
mkdir -p "$ird"/{bin,dev,proc,sys,lower,rw,root,mods}
cp /bin/busybox "$ird/bin/"
ln -s busybox "$ird/bin/sh"
mknod "$ird/dev/console" c 5 1
cp "$here/guest-init.sh" "$ird/init"
chmod 755 "$ird/init"
echo "$cache/kernel/lib/modules/$kver" > "$ird/moddir"
for m in "${modules[@]}"; do
    modprobe -d "$tmp/kernel" -S "$kver" --show-depends "$m"
done | awk '$1 == "insmod" && !seen[$2]++ {print $2}' | while read -r ko; do
    name=${ko##*/}
    case $name in
        *.xz) xz -dc "$ko" > "$ird/mods/${name%.xz}"; name=${name%.xz} ;;
        *) cp "$ko" "$ird/mods/" ;;
    esac
    echo "$name" >> "$ird/mods/order"
done
(cd "$ird" && find . | busybox cpio -o -H newc 2>/dev/null) > "$tmp/initramfs.cpio"

rm -rf "$cache/kernel" "$cache/key"
mv "$tmp/kernel" "$cache/kernel"
mv "$tmp/vmlinux" "$tmp/initramfs.cpio" "$cache/"
build_key > "$cache/key"
echo "softroce: guest boot files for kernel $kver are ready in $cache"
