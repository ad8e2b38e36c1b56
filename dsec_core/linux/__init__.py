"""The ground floor: Linux primitives (mounts, EROFS tool runs, atomic files and digests,
external programs). Nothing here imports dsec beyond ``dsec_core.errors``."""
