"""Webhooks: completions POSTed, signed, to the callback URL a request or job named (``docs/http-api.md``).

- :mod:`.settings`: the callback rules both sides read (allowed hosts, private addresses, the secret).
- :mod:`.callbacks`: the URL guard (allow-list, public addresses only, DNS resolved at each check).
- :mod:`.signing`: HMAC-SHA256 signatures of each attempt, and their check for receivers.
- :mod:`.store`: deliveries and attempts in MariaDB (enqueue, claim with a lease, record).

The door checks a ``callback_url`` when it accepts a request (``services/api/serving_webhooks.py``);
the webhooks stage (``services/webhooks/``) takes completions off Kafka and delivers them.
"""
