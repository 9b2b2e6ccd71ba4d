"""``python -m atropos.sandbox``: run one sandbox host (the program is ``host/main.py``)."""

from atropos.sandbox.host.main import main

if __name__ == "__main__":
    main()
