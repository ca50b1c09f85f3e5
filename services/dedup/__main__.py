"""``python -m services.dedup``"""

import asyncio

from services.dedup.main import main

asyncio.run(main())
