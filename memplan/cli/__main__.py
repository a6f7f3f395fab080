from memplan.cli.app import main

main()
