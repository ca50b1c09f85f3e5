"""Results: the events and documents a request ends with, and reading them back.

- :mod:`.build`: result events, stored outputs and result documents, each built in one place.
- :mod:`.completions`: reading ``ocr.completed`` from its end without a consumer group.
"""
