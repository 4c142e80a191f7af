"""The validator role's parts (the checks themselves are :mod:`validator`, shared with the coordinator's re-check).

* ``role.py`` — :class:`ValidatorNode`: lease → check → sign → post and gossip verdicts.
"""
