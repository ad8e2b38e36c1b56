"""dsec layer source plugin: the node's local content-addressed layer store."""
