from cleave_cli.app import main

main()
