#!/bin/busybox sh
# The init of every dsec VM guest (the initramfs's /init): load the drivers, mount each
# read-only layer from its device (virtio-pmem with DAX, or read-only virtio-blk), put an
# overlay over them with the writable upper on the sandbox's disk, and hand the root to
# dsec-agent, which serves the node over the virtio-serial port "dsec.agent" (its mux.c).
#
# Kernel command line (set by the backend):
#   dsec.layers=N     layers, top first: layer i is virtio-blk serial dsec-l<i>, or the
#                     virtio-pmem device at PCI slot 0x10+i (dsec.pmem=1)
#   dsec.pmem=1       layers come over virtio-pmem and are mounted with dax=always
#   dsec.blobs=I,J    layers I and J are on demand: disk dsec-l<i> holds the metadata image
#                     and disk dsec-l<i>b its data blob (mounted with device=)
#   dsec.hostname=H   the guest's hostname
# The writable disk is virtio-blk serial dsec-rw, ext4 made by the host. Every failure
# prints "dsec-init: <what>" on the console and powers off: the host reads the console.
export PATH=/bin
bb=/bin/busybox
fail() {
    echo "dsec-init: $*"
    $bb poweroff -f
}
$bb mount -t proc proc /proc
$bb mount -t sysfs sys /sys
$bb mount -t devtmpfs dev /dev
while read -r m; do
    $bb insmod "/lib/modules/$m.ko" || fail "insmod $m"
done < /lib/modules/order

layers=0 pmem=0 host=dsec blobs=""
for arg in $($bb cat /proc/cmdline); do
    case "$arg" in
    dsec.layers=*) layers=${arg#dsec.layers=} ;;
    dsec.pmem=*) pmem=${arg#dsec.pmem=} ;;
    dsec.blobs=*) blobs=",${arg#dsec.blobs=}," ;;
    dsec.hostname=*) host=${arg#dsec.hostname=} ;;
    esac
done

# Device of layer $1 (and of the disk, "rw"): by virtio-blk serial or pmem PCI slot.
device_of() {
    for b in /sys/block/*; do
        n=${b##*/}
        case "$n" in
        vd*)
            [ "$($bb cat "$b/serial" 2>/dev/null)" = "dsec-$1" ] && { echo "/dev/$n"; return; } ;;
        pmem*)
            [ "$1" = rw ] && continue
            slot=$($bb readlink -f "$b/device" | $bb sed -n 's,.*/0000:00:\([0-9a-f]*\)\.0/.*,\1,p')
            [ -n "$slot" ] && [ $((0x$slot - 0x10)) = "${1#l}" ] && { echo "/dev/$n"; return; } ;;
        esac
    done
}
# Devices appear as their drivers probe: wait a little for the slow ones.
wait_device() {
    i=0
    while [ $i -lt 200 ]; do
        d=$(device_of "$1")
        [ -n "$d" ] && [ -b "$d" ] && { echo "$d"; return; }
        $bb usleep 10000
        i=$((i + 1))
    done
}

lowers=""
i=0
while [ $i -lt "$layers" ]; do
    dev=$(wait_device "l$i")
    [ -n "$dev" ] || fail "no device for layer $i"
    $bb mkdir -p "/run/l$i"
    opts=ro
    case "$dev" in /dev/pmem*) opts=ro,dax=always ;; esac
    case "$blobs" in
    *",$i,"*)
        blob=$(wait_device "l${i}b")
        [ -n "$blob" ] || fail "no data blob device for layer $i"
        opts="$opts,device=$blob" ;;
    esac
    $bb mount -t erofs -o "$opts" "$dev" "/run/l$i" || fail "mount layer $i ($dev)"
    lowers="$lowers${lowers:+:}/run/l$i"
    i=$((i + 1))
done
disk=$(wait_device rw)
[ -n "$disk" ] || fail "no writable disk"
$bb mkdir -p /run/rw
# noinit_itable: the host formatted a sparse file, whose holes read as zeros already; ext4's
# background zeroing of inode tables cost every new VM seconds of CPU. nobarrier: nothing on it
# outlives the sandbox, and a flush is an fsync of the disk's file on the host.
$bb mount -t ext4 -o noatime,noinit_itable,nobarrier "$disk" /run/rw || fail "mount the writable disk ($disk)"
$bb mkdir -p /run/rw/upper /run/rw/work
$bb mount -t overlay overlay -o "lowerdir=$lowers,upperdir=/run/rw/upper,workdir=/run/rw/work" \
    /newroot || fail "mount the overlay"

# The port's name arrives from the host after the port itself: wait for it too.
port="" i=0
while [ -z "$port" ] && [ $i -lt 200 ]; do
    for p in /sys/class/virtio-ports/*; do
        [ "$($bb cat "$p/name" 2>/dev/null)" = dsec.agent ] && [ -c "/dev/${p##*/}" ] &&
            port=/dev/${p##*/}
    done
    [ -n "$port" ] || $bb usleep 10000
    i=$((i + 1))
done
[ -n "$port" ] || fail "no virtio-serial port dsec.agent"

# The agent and the tools this script needs in the new root, on a tmpfs of their own.
$bb mkdir -p /newroot/.dsec /newroot/proc /newroot/dev /newroot/sys /newroot/tmp
$bb mount -t tmpfs -o mode=0755,size=16m dsec /newroot/.dsec
$bb cp /dsec-agent /newroot/.dsec/agent
$bb cp /bin/busybox /newroot/.dsec/busybox
# The writable disk, read-only, where the agent finds it to freeze it (a VM's pack_diff).
$bb mkdir -p /newroot/.dsec/rw
$bb mount --bind /run/rw /newroot/.dsec/rw || fail "bind the writable disk"
$bb mount -o remount,bind,ro /newroot/.dsec/rw || fail "bind the writable disk read-only"
# The layers' mounts where the sandbox can see how they came (read-only, DAX or not).
i=0
while [ $i -lt "$layers" ]; do
    $bb mkdir -p "/newroot/.dsec/layers/$i"
    $bb mount --move "/run/l$i" "/newroot/.dsec/layers/$i" || fail "move layer $i"
    i=$((i + 1))
done
$bb mount --move /dev /newroot/dev
$bb mount --move /sys /newroot/sys
$bb umount /proc
$bb mount -t proc proc /newroot/proc  # unshare --mount-proc mounts its own over it
$bb mkdir -p /newroot/dev/pts /newroot/dev/shm
$bb mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
$bb mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
$bb hostname "$host"
$bb ip link set lo up 2>/dev/null || $bb ifconfig lo 127.0.0.1 up

echo "dsec-init: ready"
# The agent is PID 1 of a pid namespace of its own (the guest's kernel threads stay out of
# its /proc) and the sandbox's init, as in a container.
exec $bb switch_root /newroot /.dsec/busybox unshare --pid --fork --mount-proc \
    /.dsec/agent --serial "$port"
