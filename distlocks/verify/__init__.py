"""``manage.py distlocks_verify``: check a configured backend's lock under faults, Jepsen-style.

``history`` holds the checks (pure functions), ``processes`` and ``runner``
the worker processes and the faults, ``plot`` the timeline picture.
"""
