"""Verification of worker submissions: signature, task derivation, TOPLOC, sampling replay,
termination, rewards; signed verdicts and reputation."""
