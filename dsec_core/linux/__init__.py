"""The ground floor: Linux primitives (mounts, EROFS tool runs, atomic files and digests,
external programs and their table, processes by pid and pidfd, network namespaces and
rtnetlink). Nothing here imports dsec beyond ``dsec_core.errors``."""
