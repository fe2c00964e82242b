from cabinlm.cli import main

main()
