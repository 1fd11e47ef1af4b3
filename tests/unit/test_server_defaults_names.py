"""The operator side and the host installer name the plugin's server-defaults file and
variables without importing the plugin (it pulls in torch there): their copies must stay the
plugin's own, or a deploy would write a file the server never reads."""
from __future__ import annotations

from ddtree.sglang import config
from ddtree_ops import deploy_budget, recommend
from ddtree_ops.hostside import sglang_install


def test_the_copies_of_the_plugins_names_are_the_plugins():
    assert sglang_install.DEFAULTS_FILE_NAME == config.DEFAULTS_FILE_NAME
    assert (deploy_budget.ENV_ENABLE, deploy_budget.ENV_BUDGET) == (config.ENV_ENABLE, config.ENV_BUDGET)
    # the budget bounds are not copied: the operator side reads the plugin's own
    assert recommend.budget_problem(config.MAX_BUDGET) == recommend.budget_problem(config.MIN_BUDGET) == ""
    assert str(config.MAX_BUDGET + 1) in recommend.budget_problem(config.MAX_BUDGET + 1)
    assert not hasattr(deploy_budget, "MAX_BUDGET")
