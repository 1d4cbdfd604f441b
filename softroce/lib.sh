# Sourced by prepare.sh, guest.sh and pair.sh; $here is the kit directory.

cache=${SOFTROCE_CACHE:-/var/cache/argrpc-softroce}

# Identifies a build of the boot files: another recipe or another cache path (the initramfs
# records where the kernel modules live) means they must be rebuilt.
build_key() {
    { cat "$here/prepare.sh" "$here/guest-init.sh"; echo "$cache"; } | sha256sum | cut -c1-16
}

artifacts_ok() {
    [ -f "$cache/vmlinux" ] && [ -f "$cache/initramfs.cpio" ] &&
        [ "$(cat "$cache/key" 2>/dev/null)" = "$(build_key)" ]
}

# --- used by the runners only ---------------------------------------------------------

# die_setup MSG: the guest cannot even be started.
die_setup() { echo "softroce: $*" >&2; exit 125; }

# start_run: checks the prerequisites and creates $ctl, the per-run directory the guests
# mount at /run/softroce (commands, environment, output, exit status).
start_run() {
    artifacts_ok || die_setup "no guest boot files in $cache (or built by an older recipe): run $here/prepare.sh"
    command -v qemu-system-x86_64 >/dev/null || die_setup "qemu-system-x86_64 missing: run $here/prepare.sh"
    cwd=$(pwd -P)
    # $PWD is shared read-write: never hand the guest the whole host.
    [ "$cwd" != / ] || { echo "softroce: will not run in /: it would be shared read-write" >&2; exit 2; }
    timeout_s=${SOFTROCE_TIMEOUT:-1800}
    mem=${SOFTROCE_MEM:-$default_mem}
    accel=${SOFTROCE_ACCEL:-auto}
    if [ "$accel" = auto ]; then
        # /dev/kvm may exist without hardware virtualisation behind it (a nested or
        # paravirtual KVM that cannot boot a stock kernel): ask the CPU flags too.
        accel=tcg
        [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo && accel=kvm
    fi
    case $accel in
        kvm) accel_args=(-accel kvm -cpu host) ;;
        # "max": wheels such as numpy>=2 need x86-64-v2 and fail on qemu's default CPU model.
        tcg) accel_args=(-accel tcg -cpu max) ;;
        *) echo "softroce: SOFTROCE_ACCEL must be auto, kvm or tcg" >&2; exit 2 ;;
    esac
    ctl=$(mktemp -d /tmp/softroce.XXXXXX)
    printf "%s\n" "$cwd" > "$ctl/cwd"
    trap 'rm -rf "$ctl"' EXIT
    cp "$here/guest-run.sh" "$ctl/"
    write_env "$ctl/env.sh"
}

# write_env FILE: the caller's exported environment, to be replayed in the guest, with the
# caller's python3 first on PATH: pyenv shims cost seconds per start under emulation.
write_env() {
    local py var
    py=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null) && [ -n "$py" ] &&
        PATH=${py%/*}:$PATH
    for var in $(compgen -e); do
        case $var in PWD|OLDPWD|SHLVL|_|HOSTNAME) continue ;; esac
        printf 'export %s=%q\n' "$var" "${!var}"
    done > "$1"
}

# write_cmd ROLE CMD...: what the guest of this role runs.
write_cmd() {
    local role=$1
    shift
    { printf 'cmd=('; printf '%q ' "$@"; printf ')\ncwd=%q\n' "$cwd"; } > "$ctl/$role.cmd"
    : > "$ctl/$role.out"
    : > "$ctl/$role.err"
}

qemu_opt() { printf '%s' "${1//,/,,}"; }

# Boot faster under emulation: no clocksource checks, PS/2 probing or KASLR relocation.
kernel_args="console=ttyS0 quiet panic=-1 mitigations=off nokaslr tsc=reliable no_timer_check"
kernel_args+=" i8042.noaux i8042.nokbd i8042.nopnp"

# boot ROLE CPUS [QEMU ARGS...]: starts one guest in the background; $! is its qemu.
# The kernel hands the unknown boot parameter SOFTROCE_ROLE to /init as an environment
# variable. The host root is exported read-only; $ctl and $PWD read-write.
boot() {
    local role=$1 cpus=$2
    shift 2
    local share=security_model=none,multidevs=remap
    timeout -k 10 "$timeout_s" qemu-system-x86_64 -name "softroce-$role" \
        -nodefaults -no-user-config -display none -no-reboot \
        -machine q35 "${accel_args[@]}" -smp "$cpus" -m "$mem" \
        -kernel "$cache/vmlinux" -initrd "$cache/initramfs.cpio" \
        -append "$kernel_args SOFTROCE_ROLE=$role" \
        -serial "file:$ctl/$role.console" \
        -fsdev "local,id=host,path=/,readonly=on,$share" \
        -device virtio-9p-pci,fsdev=host,mount_tag=host \
        -fsdev "local,id=ctl,path=$ctl,security_model=none" \
        -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl \
        -fsdev "local,id=cwd,path=$(qemu_opt "$cwd"),$share" \
        -device virtio-9p-pci,fsdev=cwd,mount_tag=cwd \
        "$@" </dev/null >"$ctl/$role.qemu" 2>&1 &
}

# relay FILE PID: streams what the guest appends to FILE until qemu PID has exited.
# Writes over 9p reach the host file before write() returns, so nothing is lost at
# power-off, unlike output on an emulated serial line.
relay() { tail -s 0.2 -c +1 -f --pid="$2" "$1"; }

# console_tail ROLE: why a guest did not come up.
console_tail() {
    echo "--- softroce: guest $1: qemu" >&2
    tail -n 20 "$ctl/$1.qemu" >&2
    echo "--- softroce: guest $1: console (tail)" >&2
    tail -n 40 "$ctl/$1.console" >&2 2>/dev/null
}

timed_out() { [ "$1" = 124 ] || [ "$1" = 137 ]; }
