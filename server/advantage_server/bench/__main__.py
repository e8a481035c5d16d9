from advantage_server.bench import main

main()
