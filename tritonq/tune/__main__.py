from tritonq.tune.cli import main

main()
