"""One module per smoke stage; the default order lives in `ddtree_ops.hostside.protocol.STAGE_ORDER`."""
