from ikcode.cli import main

main()
