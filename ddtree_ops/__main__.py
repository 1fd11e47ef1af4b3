from ddtree_ops.cli.entry import run

run()
