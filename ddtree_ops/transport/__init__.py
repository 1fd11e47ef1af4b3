"""How ddtree-ops reaches a host: one interface, an SSH and a local implementation."""
