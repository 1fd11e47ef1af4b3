from ddtree_ops.cli.app import main

main()
