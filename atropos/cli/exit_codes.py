"""The CLI's exit codes: stable, scripts rely on them (``atropos-sandbox --help`` lists them)."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
EXIT_TIMED_OUT = 124  # exec: the command ran out of time (as timeout(1) reports it)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
