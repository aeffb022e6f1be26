"""Fuzzers: hostile clients against a real daemon.

``python -m paella.fuzz.fuzz_daemon`` starts a daemon and runs attacker processes (the
episodes of :mod:`.fuzz_attacks`) beside well-behaved clients, checking that every
legitimate request is still answered and that the daemon survives.
"""
