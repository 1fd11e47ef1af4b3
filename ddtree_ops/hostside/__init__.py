"""Everything that runs on a GPU host, in the host's own Python (stdlib, torch and `ddtree` only).

Shipped in every release (`<workdir>/current/ddtree_ops/hostside`): the agent (lock, install
release, prune, deploy/rollback; sent on stdin, stdlib only, Python >= 3.8), the release check,
the smoke runner and its stages, the SGLang installer, and the record protocol that the operator
side also imports.
"""
