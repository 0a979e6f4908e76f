from ddtree_diag.cli import main

main()
