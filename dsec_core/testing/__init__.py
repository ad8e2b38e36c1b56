"""The conformance kit: test classes and fixtures a plugin subclasses so it runs our checks.

``BackendConformance`` holds the checks every backend passes; the fixtures (loaded through the
``pytest11`` entry point) start a real, isolated node daemon and clean up every sandbox.
"""

from .backend import BackendConformance
from .fixtures import KitNode, SandboxRecorder, leftovers, make_busybox_rootfs, running_kit_node

__all__ = ["BackendConformance", "KitNode", "SandboxRecorder", "leftovers", "make_busybox_rootfs",
           "running_kit_node"]
