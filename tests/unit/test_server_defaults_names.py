"""The operator side and the host installer name the plugin's server-defaults file and
variables without importing the plugin (it pulls in torch there): their copies must stay the
plugin's own, or a deploy would write a file the server never reads."""
from __future__ import annotations

from ddtree.sglang import config
from ddtree_ops import deploy_budget
from ddtree_ops.hostside import sglang_install


def test_the_copies_of_the_plugins_names_are_the_plugins():
    assert sglang_install.DEFAULTS_FILE_NAME == config.DEFAULTS_FILE_NAME
    assert (deploy_budget.ENV_ENABLE, deploy_budget.ENV_BUDGET) == (config.ENV_ENABLE, config.ENV_BUDGET)
    assert deploy_budget.MAX_BUDGET == config.MAX_BUDGET
