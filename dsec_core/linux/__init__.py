"""The ground floor: Linux primitives (mounts, EROFS tool runs, atomic files and digests,
external programs, network namespaces and rtnetlink). Nothing here imports dsec beyond
``dsec_core.errors``."""
