"""Host-side smoke tests: the runner and one module per stage.

Travels to the hosts inside the release bundle; imports only `ddtree`, the standard library
and torch, and runs in the host's own Python from `<workdir>/current`.
"""
