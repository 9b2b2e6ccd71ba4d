#!/usr/bin/env python3
"""Regenerate atropos/sandbox/inslot/slotd_protocol.h from the slot protocol's declaration
(atropos/sandbox/inslot/inslot_protocol.py). tests/test_slot_protocol.py fails while it is stale."""

import argparse

from atropos.sandbox.host.isolation import slotd_header

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    print(slotd_header.write())
