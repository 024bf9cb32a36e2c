"""The wire contract both sides speak: messages and their encoding, close and reason codes, the
credential proofs, the verification maths a client also runs, address rules and the error tree.

It imports nothing else of Cleave, and a volunteer's client imports nothing of the coordinator
but this package (tests/test_layers.py checks both). Import its modules directly: this file
loads nothing, so ``wire.errors`` stays cheap for the store and the CLI.
"""
