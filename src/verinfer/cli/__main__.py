"""`python -m verinfer.cli`: the same command as `verinfer`."""

from verinfer.cli.main import main

main()
