"""Requests by id: who holds a client-chosen request id, and what a request without a final state is.

- :mod:`.claims`: one durable claim per client-chosen ``request_id``, taken by both doors.
- :mod:`.acceptance`: "pending" or "unknown" for an id with no final state yet.
"""
