"""Images: sniffed from their header, accepted and stored once, decoded in killable workers.

- :mod:`.accept`: accepting one image at either door (check, store under its SHA-256, describe).
- :mod:`.imaging`: format sniffing (header only) and decoding to upright 8-bit RGB pages.
- :mod:`.decoding` and :mod:`.decode_worker`: decoder processes with time and memory bounds.
- :mod:`.pixel_budget`: a process's budget of decoded-pixel bytes.
"""
