"""dsec container backend plugin: sandboxes under runc with user, pid, mount, net, ipc and uts namespaces."""
