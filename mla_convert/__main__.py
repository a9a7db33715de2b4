from mla_convert.cli.app import main

main()
