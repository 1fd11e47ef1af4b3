"""Scripts that run on the hosts in the host's own Python (stdlib only, Python >= 3.8).

They are never imported on the operator side: `ddtree_ops.remote_layout` reads their source and
sends it over the connection (see `agent_stdin`)."""
