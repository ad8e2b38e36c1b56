"""The suite's pytest set-up: dsec's test kit is opt-in (as pytester is), and this repository
opts in for its own tests and every plugin's."""

import os

pytest_plugins = ["dsec_core.testing"]

# Every test node's VM backends share one cache of guest kernels, initramfs, pmem images and
# start templates (else each session's node would fetch a kernel again).
os.environ.setdefault("DSEC_VM_CACHE", "/var/cache/dsec-test-vm")
