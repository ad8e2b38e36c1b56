"""Virtual-machine guests: the boot files a QEMU guest starts from (``guest``: a Debian kernel
fetched into a cache, its modules and an initramfs), written in ``cpio`` with ``elf`` reading
the modules. A floor beside ``dsec_core.agent``: only errors, records, config and the Linux
primitives below it."""
