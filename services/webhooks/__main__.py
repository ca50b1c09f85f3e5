"""``python -m services.webhooks``"""

import asyncio

from services.webhooks.main import main

asyncio.run(main())
